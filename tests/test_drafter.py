"""EAGLE-3 drafter: draft vocabulary maps, speculators checkpoint round trip, vLLM 0.26.0 compatibility."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from eagle3lab.drafter import (
    DrafterConfig,
    Eagle3Drafter,
    build_draft_vocab,
    causal_mask,
    draft_to_target,
    expected_vllm_weight_shapes,
    load_drafter,
    save_drafter,
    target_to_draft,
    token_counts_from_sequences,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(**kw) -> DrafterConfig:
    base = dict(
        vocab_size=50, draft_vocab_size=20, hidden_size=32, target_hidden_size=32, aux_layer_ids=[3, 1, 2],
        intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0,
    )
    base.update(kw)
    return DrafterConfig(**base)


def tiny_drafter(seed: int = 0, **kw) -> Eagle3Drafter:
    cfg = tiny_cfg(**kw)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (cfg.vocab_size,), generator=g)
    d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
    torch.manual_seed(seed)
    return Eagle3Drafter(cfg, d2t, t2d)


def test_draft_vocab_picks_most_frequent_and_round_trips():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    # Top 4 by count: 2 (9), 3 (9), 5 (7), 0 (5); sorted by target id: 0, 2, 3, 5.
    assert torch.nonzero(t2d).flatten().tolist() == [0, 2, 3, 5]
    assert d2t.tolist() == [0, 1, 1, 2]
    draft = torch.arange(4)
    tgt = draft_to_target(draft, d2t)
    assert tgt.tolist() == [0, 2, 3, 5]
    assert torch.equal(target_to_draft(tgt, t2d), draft)
    # Tokens outside the draft vocabulary map to the "missing" marker.
    assert target_to_draft(torch.tensor([1, 4, 7]), t2d, missing=-1).tolist() == [-1, -1, -1]


def test_draft_vocab_round_trip_random():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 20, (300,), generator=g)  # many ties
    d2t, t2d = build_draft_vocab(counts, 64)
    draft = torch.arange(64)
    assert torch.equal(target_to_draft(draft_to_target(draft, d2t), t2d), draft)
    chosen = counts[t2d]
    assert int(chosen.min()) >= int(counts[~t2d].max())  # nothing left out is more frequent


def test_token_counts_and_bad_inputs():
    c = token_counts_from_sequences([[1, 2, 2], torch.tensor([2, 0])], 4)
    assert c.tolist() == [1, 1, 3, 0]
    with pytest.raises(ValueError, match="out of range"):
        token_counts_from_sequences([[5]], 4)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10), 11)


def test_config_validation():
    with pytest.raises(ValueError, match="shared embeddings"):
        tiny_cfg(hidden_size=64)
    with pytest.raises(ValueError, match="no ids"):
        tiny_cfg(aux_layer_ids=[])
    with pytest.raises(ValueError, match="duplicates"):
        tiny_cfg(aux_layer_ids=[2, 2, 3])
    assert tiny_cfg().aux_layer_ids == [1, 2, 3]


def test_aux_width_mismatch_raises():
    d = tiny_drafter()
    with pytest.raises(ValueError, match="aux width 64 does not match"):
        d.combine_hidden_states(torch.zeros(2, 64))


def test_causal_mask_alignment():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_diagonal_steps_match_single_query_decoding():
    """Batched TTT-style step 2 at every anchor equals running each anchor's chain alone (propose path)."""
    d = tiny_drafter().eval()
    t = 7
    ids = torch.randint(0, 50, (1, t + 1))
    hid = d.combine_hidden_states(torch.randn(1, t, 96))
    pos = torch.arange(t)[None]
    mask = causal_mask(t, t)[None]
    with torch.no_grad():
        n0, h0, kv0 = d.step(ids[:, :t], hid, pos, [], mask)
        n1, _, _ = d.step(ids[:, 1:], h0, pos + 1, [kv0], mask)
        for a in range(t):
            # Anchor a alone: first pass over 0..a, then one query at position a+1.
            _, h0a, kv0a = d.step(ids[:, : a + 1], hid[:, : a + 1], pos[:, : a + 1], [], None)
            assert torch.allclose(h0a[:, -1], h0[:, a], atol=1e-5)
            first = torch.ones(1, 1, a + 1, dtype=torch.bool)
            n1a, _, _ = d.step(ids[:, a + 1 : a + 2], h0a[:, -1:], pos[:, a : a + 1] + 1, [kv0a], first)
            assert torch.allclose(n1a[:, 0], n1[:, a], atol=1e-5)


def test_save_load_round_trip_shared_embeddings(tmp_path: Path):
    d = tiny_drafter()
    emb = torch.randn(50, 32)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(emb)
    out = save_drafter(d, tmp_path / "drafter", "/nonexistent/target", num_speculative_tokens=3)
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert "embed_tokens.weight" not in names
    assert names == set(expected_vllm_weight_shapes(d.config))
    back = load_drafter(out, embed_weight=emb)
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_drafter(out)  # shared embeddings and a verifier that is not a folder


def test_save_load_own_embeddings(tmp_path: Path):
    d = tiny_drafter(hidden_size=16, shared_embeddings=False, intermediate_size=24)
    out = save_drafter(d, tmp_path / "d2", "some/target")
    back = load_drafter(out)
    assert torch.equal(back.embed_tokens.weight, d.embed_tokens.weight)
    x = torch.randn(1, 5, 96)
    ids = torch.randint(0, 50, (6,))
    assert d.propose(ids, x[0], 3) == back.propose(ids, x[0], 3)


def test_weight_names_and_shapes_match_vllm_source(tmp_path: Path):
    """Names/shapes saved == what llama_eagle3.py builds, with the names derived from vLLM's own source.

    Instantiating vLLM's module needs a vLLM config and a GPU platform, so we read the installed file
    instead: the submodules its LlamaModel / decoder layer create (fc, layers, norm, hidden_norm, the
    2*hidden qkv input) and its load_weights renames (d2t, t2d skipped, "model." prefix).
    """
    vllm = pytest.importorskip("vllm")
    src = (Path(vllm.__file__).parent / "model_executor/models/llama_eagle3.py").read_text()
    assert "qkv_input_size = 2 * self.hidden_size if layer_idx == 0" in src
    assert re.search(r"self\.hidden_norm = RMSNorm\(config\.hidden_size", src)
    assert re.search(r"self\.fc = ReplicatedLinear\(\s*input_size=self\.fc_input_size", src)
    assert '"d2t", "draft_id_to_target_id"' in src.replace("name.replace(", "").replace("'", '"')
    assert 'if "t2d" in name' in src
    assert '".q_proj": (".qkv_proj", "q")' in src and '".gate_proj": (".gate_up_proj", 0)' in src
    d = tiny_drafter()
    out = save_drafter(d, tmp_path / "d", "t")
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_vllm_weight_shapes(d.config)
    assert sd["d2t"].dtype == torch.int64
    assert sd["fc.weight"].shape == (32, 3 * 32)
    assert sd["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 32


def test_vllm_reads_saved_config(tmp_path: Path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    d = tiny_drafter(aux_layer_ids=[2, 4])
    target = tmp_path / "target"
    target.mkdir()
    out = save_drafter(d, tmp_path / "drafter", target, num_speculative_tokens=3,
                       verifier_architectures=["DeepseekV3ForCausalLM"])
    cfg = SpeculatorsConfig.from_pretrained(str(out))
    assert cfg.architectures == ["Eagle3LlamaForCausalLM"]
    assert list(cfg.eagle_aux_hidden_state_layer_ids) == [2, 4]
    assert cfg.draft_vocab_size == 20
    assert cfg.target_hidden_size == 32
    assert cfg.hidden_size == 32 and cfg.vocab_size == 50
    assert cfg.norm_before_residual is False
    assert cfg.num_aux_hidden_states == 2  # what vLLM's Eagle3 LlamaModel sizes fc with
    model, tok, spec = maybe_override_with_speculators(str(out), None, False)
    assert model == str(target) and spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    # The route vLLM takes to build the draft model's hf_config.
    from vllm.transformers_utils.config import get_config

    hf = get_config(str(out), trust_remote_code=False)
    assert hf.architectures == ["Eagle3LlamaForCausalLM"] and list(hf.eagle_aux_hidden_state_layer_ids) == [2, 4]
    assert hf.rope_parameters["rope_theta"] == 1000.0 and hf.num_hidden_layers == 1 and hf.head_dim == 8
    raw = json.loads((out / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4]  # top level: DESIGN.md


def test_corrupt_drafter_weights_are_named(tmp_path: Path):
    """A drafter whose model.safetensors was cut short says which file, not safetensors' header message alone."""
    from eagle3lab.errors import CorruptFileError

    out = save_drafter(tiny_drafter(hidden_size=16, shared_embeddings=False, intermediate_size=24), tmp_path / "d",
                       "some/target")
    weights = out / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CorruptFileError, match="truncated") as err:
        load_drafter(out)
    assert str(weights) in str(err.value)
    weights.write_bytes(b"{not a header" + raw[13:])
    with pytest.raises(CorruptFileError, match="corrupt drafter weights file"):
        load_drafter(out)
