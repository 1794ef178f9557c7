"""Our drafter's numerics against vLLM's own ops, composed as vLLM 0.26.0's ``llama_eagle3.py`` composes them.

What is built from vLLM here: ``RMSNorm`` (plain and fused add-then-norm), the rotary embedding from
``get_rope`` (neox style, the Llama default), ``SiluAndMul``, each on its ``forward_native`` path (the
reference implementation vLLM's kernels are tested against). They need only a current vLLM config with the
CPU device.

What is not built: ``Eagle3LlamaForCausalLM`` itself. Its constructor needs tensor-parallel groups
(``QKVParallelLinear``, ``VocabParallelEmbedding``), an attention backend for the platform (the lean CPU
install has none: ``VllmConfig()`` cannot even infer a device), and its forward needs a forward context
with attention metadata. Faking those would test the fakes. So the layer is composed from vLLM's ops in
the order ``LlamaDecoderLayer.forward`` / ``LlamaModel.forward`` of the installed ``llama_eagle3.py`` use
(the source is checked for those lines, so a change in vLLM fails here instead of comparing against a stale
composition), with causal scaled-dot-product attention (what vLLM's backends compute for one prefill).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs an installed vLLM")
torch = pytest.importorskip("torch")

from eagle3lab import vllm_compat  # noqa: E402
from eagle3lab.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab  # noqa: E402

pytestmark = [
    pytest.mark.skipif(vllm_compat.version_tuple() != (0, 26),
                       reason="the drafter follows vLLM 0.26.0's llama_eagle3.py (what the GPU image pins)"),
    pytest.mark.usefixtures("one_thread"),
]

# The lines of llama_eagle3.py the composition below follows (0.26.0).
SOURCE_LINES = (
    "embeds = self.input_layernorm(embeds)",
    "hidden_states, residual = self._residual_norm(hidden_states=hidden_states)",
    "hidden_states = torch.cat([embeds, hidden_states], dim=-1)",
    "hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states, hidden_prenorm = self.norm(hidden_states, residual)",
    "residual = hidden_states\n        hidden_states = self.hidden_norm(hidden_states)",  # _norm_after_residual
)


@pytest.fixture(scope="module")
def vllm_ops():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    ctx = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
    ctx.__enter__()
    yield {"RMSNorm": RMSNorm, "get_rope": get_rope, "SiluAndMul": SiluAndMul}
    ctx.__exit__(None, None, None)


# float32 throughout, as both implementations compute their statistics in float32: agreement to rounding
# (a few ulps through a dozen ops); a wrong op order, a swapped norm or other rotary pairs differ by O(1).
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _drafter(seed: int = 0) -> Eagle3Drafter:
    cfg = DrafterConfig(vocab_size=64, draft_vocab_size=32, hidden_size=32, target_hidden_size=32,
                        aux_layer_ids=[1, 2, 3], intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=1e-5)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(seed)), 32)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, d2t, t2d).eval()
    with torch.no_grad():  # norms away from 1, so a swapped or skipped norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter


def _norm(ops, ours):
    n = ops["RMSNorm"](ours.weight.numel(), eps=ours.eps)
    with torch.no_grad():
        n.weight.copy_(ours.weight)
    return n


def test_source_still_composes_the_layer_this_way():
    src = vllm_compat.read_source("model_executor/models/llama_eagle3.py")
    missing = [line for line in SOURCE_LINES if line not in src]
    assert not missing, f"vLLM's llama_eagle3.py changed; update this composition: {missing}"


def test_norms_rotary_and_mlp_equal_vllms(vllm_ops):
    d = _drafter()
    layer = d.layers[0]
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    vnorm = _norm(vllm_ops, layer.post_attention_layernorm)
    torch.testing.assert_close(layer.post_attention_layernorm(x), vnorm.forward_native(x), **FP32)
    normed, summed = vnorm.forward_native(x.clone(), r.clone())  # vLLM's fused "add residual, then norm"
    torch.testing.assert_close(summed, x + r, **FP32)
    torch.testing.assert_close(normed, layer.post_attention_layernorm(x + r), **FP32)

    hd = d.config.head_dim
    rope = vllm_ops["get_rope"](hd, max_position=64, is_neox_style=True,
                                rope_parameters={"rope_type": "default", "rope_theta": d.config.rope_theta})
    pos = torch.tensor([0, 1, 2, 7, 30])
    q = torch.randn(5, 4 * hd, generator=g)
    k = torch.randn(5, 2 * hd, generator=g)
    vq, vk = rope.forward_native(pos, q.clone(), k.clone())
    from eagle3lab.drafter import rotary

    def ours(t, heads):  # [T, heads*hd] -> our [B, heads, T, hd] layout and back
        out = rotary(t.view(1, 5, heads, hd).transpose(1, 2), pos[None], d.config.rope_theta)
        return out.transpose(1, 2).reshape(5, heads * hd)

    torch.testing.assert_close(ours(q, 4), vq, **FP32)
    torch.testing.assert_close(ours(k, 2), vk, **FP32)

    h = torch.randn(5, 32, generator=g)
    gate_up = torch.cat([layer.mlp.gate_proj(h), layer.mlp.up_proj(h)], dim=-1)  # vLLM's merged gate_up_proj
    vmlp = layer.mlp.down_proj(vllm_ops["SiluAndMul"]().forward_native(gate_up))
    torch.testing.assert_close(layer.mlp(h), vmlp, **FP32)


def test_first_pass_equals_vllms_composition(vllm_ops):
    """One drafter forward (first pass over a sequence) against llama_eagle3's forward built from vLLM's ops."""
    import torch.nn.functional as F

    d = _drafter(seed=3)
    cfg, layer = d.config, d.layers[0]
    g = torch.Generator().manual_seed(2)
    t = 9
    ids = torch.randint(0, 64, (t,), generator=g)
    aux = torch.randn(t, 3 * 32, generator=g)
    pos = torch.arange(t)

    with torch.no_grad():
        # ours
        hidden = d.combine_hidden_states(aux[None])
        normed, prenorm, _ = d.step(ids[None], hidden, pos[None], [])
        ours_logits = d.target_logits(normed)[0]

        # vLLM's composition (LlamaDecoderLayer.forward with layer_idx 0, then LlamaModel.forward's norm)
        n_in, n_hidden = _norm(vllm_ops, layer.input_layernorm), _norm(vllm_ops, layer.hidden_norm)
        n_post, n_final = _norm(vllm_ops, layer.post_attention_layernorm), _norm(vllm_ops, d.norm)
        rope = vllm_ops["get_rope"](cfg.head_dim, max_position=64, is_neox_style=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
        h = F.linear(aux, d.fc.weight)  # combine_hidden_states: fc (ReplicatedLinear, no bias)
        embeds = n_in.forward_native(d.embed_tokens(ids))
        residual, h = h, n_hidden.forward_native(h)  # _norm_after_residual (norm_before_residual False)
        x = torch.cat([embeds, h], dim=-1)
        attn = layer.self_attn
        q, k, v = F.linear(x, attn.q_proj.weight), F.linear(x, attn.k_proj.weight), F.linear(x, attn.v_proj.weight)
        q, k = rope.forward_native(pos, q, k)
        heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = q.view(t, heads, hd).transpose(0, 1)
        k = k.view(t, kv, hd).transpose(0, 1).repeat_interleave(heads // kv, 0)
        v = v.view(t, kv, hd).transpose(0, 1).repeat_interleave(heads // kv, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, heads * hd)
        h, residual = n_post.forward_native(F.linear(o, attn.o_proj.weight), residual)
        gate_up = torch.cat([F.linear(h, layer.mlp.gate_proj.weight), F.linear(h, layer.mlp.up_proj.weight)], -1)
        h = F.linear(vllm_ops["SiluAndMul"]().forward_native(gate_up), layer.mlp.down_proj.weight)
        final, hidden_prenorm = n_final.forward_native(h, residual)
        # compute_logits: draft logits scattered to target ids i + d2t[i], -inf elsewhere
        draft_logits = F.linear(final, d.lm_head.weight)
        vllm_logits = draft_logits.new_full((t, cfg.vocab_size), float("-inf"))
        vllm_logits[:, torch.arange(cfg.draft_vocab_size) + d.d2t] = draft_logits

    torch.testing.assert_close(normed[0], final, **FP32)
    torch.testing.assert_close(prenorm[0], hidden_prenorm, **FP32)  # what vLLM feeds back
    torch.testing.assert_close(ours_logits, vllm_logits, **FP32)
