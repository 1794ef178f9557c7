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
