"""eagle3lab.lint: each finding triggered by a crafted drafter config, on the installed vLLM's rules.

The lint reads vLLM's source files without importing vLLM, so these tests are fast.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from importlib.metadata import version

import pytest

# find_spec, not importorskip: the lint never imports vLLM (that import alone takes ~20 s of CPU).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from eagle3lab.aux_layers import sglang_default_ids  # noqa: E402
from eagle3lab.lint import format_lint, lint_drafter, safetensors_shapes  # noqa: E402

VERSION = tuple(int(p) for p in version("vllm").split(".")[:2])
L, H, V = 61, 7168, 163840  # Kimi-K2.5's text stack


def _target(tmp_path, layers=L, hidden=H, vocab=V):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "model_type": "deepseek_v3",
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "vocab_size": vocab,
        },
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _drafter(tmp_path, tensors=None, **over):
    """A speculators-format EAGLE-3 drafter config (clean by default), optionally with weights' headers."""
    d = tmp_path / "drafter"
    d.mkdir(exist_ok=True)
    cfg = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        # Published Kimi-K2.5 drafters keep head_dim 128 (56 heads at 7168): a shape vLLM serves.
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "num_hidden_layers": 1,
                                     "num_attention_heads": 56, "head_dim": 128},
        "draft_vocab_size": 32000,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
    }
    for k, v in over.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        _write_safetensors(d / "model.safetensors", tensors)
    return d


def _write_safetensors(path, tensors: dict[str, list[int]]):
    # Header only plus zero bytes: the lint reads shapes from the header and never the data.
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 2
        for s in shape:
            n *= s
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        fh.seek(offset - 1, 1)
        fh.write(b"\0")


SMALL = {"fc.weight": [8, 24], "d2t": [10], "lm_head.weight": [10, 8]}  # H=8, 3 aux, draft vocab 10


def _codes(r, severity=None):
    return {f.code for f in r.findings if severity is None or f.severity == severity}


def test_clean_config_has_no_errors(tmp_path):
    r = lint_drafter(_drafter(tmp_path), _target(tmp_path))
    assert not r.has_errors, format_lint(r)
    assert "AUX_CONVENTION" in _codes(r, "info")  # always stated
    assert "AUX_SGLANG" not in _codes(r)
    assert r.aux_ids == [2, 30, 58]
    d = r.to_dict()
    assert d["has_errors"] is False and json.dumps(d)


def test_clean_small_drafter_with_weights(tmp_path):
    t = _target(tmp_path, layers=6, hidden=8, vocab=64)
    dr = _drafter(
        tmp_path, SMALL, target_hidden_size=8, draft_vocab_size=10,
        transformer_layer_config={"model_type": "llama", "hidden_size": 8}, eagle_aux_hidden_state_layer_ids=[1, 3, 6],
    )
    assert safetensors_shapes(dr)["fc.weight"] == [8, 24]
    r = lint_drafter(dr, t)
    assert not r.has_errors, format_lint(r)


def test_sglang_ids_detected_with_vllm_ids(tmp_path):
    assert sglang_default_ids(61) == [1, 29, 57]
    r = lint_drafter(_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 29, 57]), _target(tmp_path))
    f = next(f for f in r.findings if f.code == "AUX_SGLANG")
    assert f.severity == "warning" and "[2, 30, 58]" in f.message and "SGLang" in f.message


def test_specforge_named_config_is_flagged(tmp_path):
    r = lint_drafter(
        _drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[3, 31, 59], trained_with="SpecForge"),
        _target(tmp_path),
    )
    f = next(f for f in r.findings if f.code == "AUX_SGLANG")
    assert "specforge" in f.message and "[4, 32, 60]" in f.message


@pytest.mark.parametrize(
    ("ids", "code", "layers"),
    [
        ([2, 3, 3], "AUX_DUPLICATE", 6),
        ([0, 3, 5], "AUX_ZERO", 6),
        ([2, 3, 9], "AUX_RANGE", 6),
    ],
)
def test_aux_id_errors(tmp_path, ids, code, layers):
    r = lint_drafter(_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=ids), _target(tmp_path, layers=layers))
    assert code in _codes(r, "error") and r.has_errors


def test_not_ascending_is_a_warning(tmp_path):
    r = lint_drafter(_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[30, 2, 58]), _target(tmp_path))
    assert "AUX_ORDER" in _codes(r, "warning")


def test_default_ids_collapse_for_six_layers(tmp_path):
    r = lint_drafter(_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=None), _target(tmp_path, layers=6))
    assert "AUX_DEFAULT" in _codes(r) and "AUX_DUPLICATE" in _codes(r, "error")


def test_ids_only_under_eagle_config(tmp_path):
    r = lint_drafter(
        _drafter(tmp_path, eagle_aux_hidden_state_layer_ids=None, eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}),
        _target(tmp_path),
    )
    f = next(f for f in r.findings if f.code == "AUX_PLACEMENT")
    # Both releases have a runner that reads only the top level (0.17's V1 runner, 0.26's V2 runner).
    assert f.severity == "error" and "eagle3_utils.py" in f.message


def test_fc_width_from_weights(tmp_path):
    t = _target(tmp_path, layers=6, hidden=8, vocab=64)
    dr = _drafter(
        tmp_path, {**SMALL, "fc.weight": [8, 32]}, target_hidden_size=8, draft_vocab_size=10,
        eagle_aux_hidden_state_layer_ids=[1, 3, 6],
    )
    r = lint_drafter(dr, t)
    f = next(f for f in r.findings if f.code == "FC_WIDTH")
    assert "[8, 32]" in f.message and "4 aux states" in f.message


def test_four_ids_vs_what_vllm_builds(tmp_path):
    r = lint_drafter(_drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[2, 20, 40, 58]), _target(tmp_path))
    assert "FC_COUNT" in _codes(r, "error")
    if VERSION >= (0, 18):  # num_aux_hidden_states is honoured from 0.18 on
        r = lint_drafter(
            _drafter(tmp_path, eagle_aux_hidden_state_layer_ids=[2, 20, 40, 58], num_aux_hidden_states=4),
            _target(tmp_path),
        )
        assert "FC_COUNT" not in _codes(r)


def test_hidden_size_mismatch(tmp_path):
    r = lint_drafter(_drafter(tmp_path, target_hidden_size=4096), _target(tmp_path))
    assert "HIDDEN_SIZE" in _codes(r, "error")


def test_vocab_checks(tmp_path):
    r = lint_drafter(_drafter(tmp_path, draft_vocab_size=V + 1), _target(tmp_path))
    assert "VOCAB_SIZE" in _codes(r, "error")
    t = _target(tmp_path, layers=6, hidden=8, vocab=64)
    no_d2t = {k: v for k, v in SMALL.items() if k != "d2t"}
    r = lint_drafter(
        _drafter(tmp_path, no_d2t, target_hidden_size=8, draft_vocab_size=10, eagle_aux_hidden_state_layer_ids=[1, 3, 6]),
        t,
    )
    assert "VOCAB_D2T" in _codes(r, "error")


def test_architecture_acceptance(tmp_path):
    r = lint_drafter(_drafter(tmp_path, speculators_model_type="medusa9"), _target(tmp_path))
    assert "ARCH" in _codes(r, "error")
    r = lint_drafter(
        _drafter(tmp_path, speculators_model_type=None, architectures=["LlamaForCausalLMEagle3"]), _target(tmp_path)
    )
    assert "ARCH" not in _codes(r)
    r = lint_drafter(
        _drafter(tmp_path, speculators_model_type=None, architectures=["MyEagle3Drafter"]), _target(tmp_path)
    )
    assert "ARCH" in _codes(r, "error")
    text = format_lint(r)
    assert text.index("ERROR") < text.index("INFO")


def test_missing_drafter_config(tmp_path):
    from eagle3lab.errors import InputError

    with pytest.raises(InputError, match="config not found"):
        lint_drafter(tmp_path / "nope", _target(tmp_path))


@pytest.mark.parametrize("where", ["top level", "transformer_layer_config"])
def test_drafter_vocab_size_must_be_the_targets(tmp_path, where):
    """A drafter's vocab_size is the target's vocabulary (its d2t maps into it); another size makes vLLM build
    embeddings and a token map for a vocabulary the target does not have."""
    t = _target(tmp_path, layers=6, hidden=8, vocab=64)
    layer = {"model_type": "llama", "hidden_size": 8}
    over = {"vocab_size": 65} if where == "top level" else {"transformer_layer_config": {**layer, "vocab_size": 65}}
    kw = {"transformer_layer_config": layer, **over}
    r = lint_drafter(_drafter(tmp_path, SMALL, target_hidden_size=8, draft_vocab_size=10,
                              eagle_aux_hidden_state_layer_ids=[1, 3, 6], **kw), t)
    msgs = [f.message for f in r.findings if f.code == "VOCAB_SIZE" and f.severity == "error"]
    assert msgs and "vocab_size 65" in msgs[0] and "64" in msgs[0], format_lint(r)
    # the same drafter with the target's vocab_size is clean
    same = {"vocab_size": 64} if where == "top level" else {"transformer_layer_config": {**layer, "vocab_size": 64}}
    r = lint_drafter(_drafter(tmp_path, SMALL, target_hidden_size=8, draft_vocab_size=10,
                              eagle_aux_hidden_state_layer_ids=[1, 3, 6], **{**kw, **same}), t)
    assert not r.has_errors, format_lint(r)


def test_d2t_length_and_lm_head_rows_must_be_the_draft_vocab(tmp_path):
    t = _target(tmp_path, layers=6, hidden=8, vocab=64)
    cfg = dict(target_hidden_size=8, draft_vocab_size=10, eagle_aux_hidden_state_layer_ids=[1, 3, 6],
               transformer_layer_config={"model_type": "llama", "hidden_size": 8})
    r = lint_drafter(_drafter(tmp_path, {**SMALL, "d2t": [9]}, **cfg), t)
    assert [f.message for f in r.findings if f.code == "VOCAB_D2T" and f.severity == "error"] == [
        "d2t has 9 entries, draft_vocab_size is 10"], format_lint(r)
    r = lint_drafter(_drafter(tmp_path, {**SMALL, "lm_head.weight": [12, 8]}, **cfg), t)
    assert [f.message for f in r.findings if f.code == "VOCAB_SIZE" and f.severity == "error"] == [
        "lm_head.weight has 12 rows, draft_vocab_size is 10"], format_lint(r)


# --------------------------------------------------------------------------------------------------
# Targets of other families: the text stack's fields wherever the family keeps them
# --------------------------------------------------------------------------------------------------

# config.json excerpts of published checkpoints (the fields the lint and transformers' config classes read).
GLM4_MOE = {  # GLM-4.5-Air: grouped-query attention, a routed MoE with a router bias, one MTP layer
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46,
    "vocab_size": 151552, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
}
MIXTRAL = {  # Mixtral-8x7B
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
    "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
GEMMA3 = {  # Gemma-3-27B-it: a multimodal wrapper; its text_config carries no vocab_size (transformers' default)
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27,
                      "image_size": 896, "patch_size": 14},
}
FAMILIES = {"glm4_moe": (GLM4_MOE, 46, 4096, 151552), "mixtral": (MIXTRAL, 32, 4096, 32000),
            "gemma3": (GEMMA3, 62, 5376, 262208)}


def _family_target(tmp_path, cfg, tensors=None):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        _write_safetensors(d / "model.safetensors", tensors)
    return d


def _family_drafter(tmp_path, layers, hidden, vocab, **over):
    """A clean speculators drafter for a target of ``layers`` x ``hidden`` and vocabulary ``vocab``."""
    from eagle3lab.aux_layers import default_aux_layer_ids

    cfg = dict(
        transformer_layer_config={"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1,
                                  "num_attention_heads": hidden // 128, "head_dim": 128, "vocab_size": vocab},
        target_hidden_size=hidden, draft_vocab_size=min(32000, vocab),
        eagle_aux_hidden_state_layer_ids=default_aux_layer_ids(layers),
    )
    return _drafter(tmp_path, **{**cfg, **over})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_fields(tmp_path, family):
    from eagle3lab.lint import target_fields

    cfg, layers, hidden, vocab = FAMILIES[family]
    t = target_fields(_family_target(tmp_path, cfg))
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (layers, hidden, vocab)
    assert t.text_config_key == ("text_config" if family == "gemma3" else None)
    assert t.from_transformers == (["vocab_size"] if family == "gemma3" else [])


def test_fields_under_other_names_come_from_transformers(tmp_path):
    """GPT-2 names its fields n_layer / n_embd: transformers' attribute map gives them, as vLLM reads them."""
    from eagle3lab.lint import target_fields

    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12, "n_embd": 768,
           "vocab_size": 50257}
    t = target_fields(_family_target(tmp_path, cfg))
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (12, 768, 50257)
    assert t.from_transformers == ["num_hidden_layers", "hidden_size"]


def test_unknown_fields_are_said(tmp_path):
    cfg = {"architectures": ["SomeRemoteCodeForCausalLM"], "model_type": "not_in_transformers", "hidden_size": 64}
    r = lint_drafter(_family_drafter(tmp_path, 6, 64, 1000), _family_target(tmp_path, cfg))
    f = next(f for f in r.findings if f.code == "TARGET_UNKNOWN")
    assert f.severity == "warning" and "num_hidden_layers, vocab_size" in f.message, format_lint(r)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_clean_drafter(tmp_path, family):
    cfg, layers, hidden, vocab = FAMILIES[family]
    r = lint_drafter(_family_drafter(tmp_path, layers, hidden, vocab), _family_target(tmp_path, cfg))
    assert not r.has_errors, format_lint(r)
    assert not _codes(r, "warning") - {"DRAFTER_HEAD_DIM"}, format_lint(r)
    target = next(f.message for f in r.findings if f.code == "TARGET")
    assert cfg["architectures"][0] in target and f"num_hidden_layers {layers}" in target
    # the top id the target has (its final pre-norm state) is in range; one more is not
    r = lint_drafter(_family_drafter(tmp_path, layers, hidden, vocab, eagle_aux_hidden_state_layer_ids=[2, 10, layers]),
                     _family_target(tmp_path, cfg))
    assert not r.has_errors, format_lint(r)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    ("mistake", "code"),
    [("hidden", "HIDDEN_SIZE"), ("aux", "AUX_RANGE"), ("vocab", "VOCAB_SIZE")],
)
def test_other_families_wrong_drafter(tmp_path, family, mistake, code):
    cfg, layers, hidden, vocab = FAMILIES[family]
    over = {
        "hidden": {"target_hidden_size": hidden + 1024},
        "aux": {"eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers + 1]},
        # Gemma-3's tokenizer has 262144 tokens, its embedding 262208 rows (transformers' default): vLLM uses the latter
        "vocab": {"vocab_size": 262144 if family == "gemma3" else vocab + 1},
    }[mistake]
    r = lint_drafter(_family_drafter(tmp_path, layers, hidden, vocab, **over), _family_target(tmp_path, cfg))
    assert _codes(r, "error") == {code}, format_lint(r)
    msg = next(f.message for f in r.findings if f.code == code)
    assert str({"hidden": hidden, "aux": layers, "vocab": vocab}[mistake]) in msg


def test_router_rule_only_for_deepseek_v2_stacks(tmp_path):
    """GLM-4-MoE checkpoints carry the router bias without topk_method (vLLM's glm4_moe.py always creates it):
    DeepSeek-V2's rule must not refuse them, and must still refuse a DeepSeek-V3 stack (Kimi-K2.5's) without it."""
    bias = {"model.layers.1.mlp.gate.e_score_correction_bias": [128], "model.layers.1.mlp.gate.weight": [128, 8]}
    r = lint_drafter(_family_drafter(tmp_path, 46, 4096, 151552), _family_target(tmp_path, GLM4_MOE, bias))
    assert not r.has_errors, format_lint(r)
    f = next(f for f in r.findings if f.code == "ROUTER_BIAS")
    assert f.severity == "info" and "glm4_moe.py" in f.message
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": L, "hidden_size": H, "vocab_size": V,
                            "n_routed_experts": 128}}
    r = lint_drafter(_drafter(tmp_path), _family_target(tmp_path, kimi, bias))
    assert "ROUTER_BIAS" in _codes(r, "error"), format_lint(r)
