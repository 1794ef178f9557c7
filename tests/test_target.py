"""The embedded target: corpus, tokenizer, config, training, save/load, vLLM config acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lab import target as T
from eagle3lab import target_loading as TL


@pytest.fixture(scope="module")
def spec():
    return T.tiny_spec()


@pytest.fixture(scope="module")
def corpus(spec):
    return T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)


@pytest.fixture(scope="module")
def tokenizer(corpus, spec):
    return T.train_tokenizer(corpus, spec.vocab_size)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, spec):
    path = tmp_path_factory.mktemp("target")
    model, tok, result, _ = T.build_embedded_target(spec, path, seed=0)
    return path, model, tok, result


def test_corpus_split_by_file_and_deterministic(corpus, spec):
    again = T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)
    assert again.train_files == corpus.train_files and again.heldout_files == corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    assert all(f.endswith(".py") and "site-packages" not in f for f in corpus.train_files)
    total = corpus.train_bytes + corpus.heldout_bytes
    assert total <= spec.corpus_max_bytes and total > 0.9 * spec.corpus_max_bytes
    with pytest.raises(ValueError, match="heldout_fraction"):
        T.build_corpus(10_000, 0.7)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        T.build_corpus(10_000, 0.1, source_dir="/no/such/folder")


def test_a_first_file_larger_than_the_corpus_leaves_a_training_split(tmp_path):
    # On the GPU host (Python 3.12's stdlib), the first file in hash order was larger than a 20 kB corpus: the
    # held-out split took all of it and build_corpus raised "too little text". Here b.py comes first in hash order.
    (tmp_path / "b.py").write_text("x = 1\n" * 10_000)  # 60 kB
    for name in ("f.py", "e.py", "a.py"):
        (tmp_path / name).write_text(f"# {name}\n" + "y = 2\n" * 500)
    c = T.build_corpus(20_000, 0.05, source_dir=tmp_path)
    assert c.heldout_files == ["b.py"] and c.train_files[0] == "f.py"
    held, train = sum(len(t.encode()) for t in c.heldout_texts), sum(len(t.encode()) for t in c.train_texts)
    assert held == 10_000 and 0 < train <= 10_000


def test_tokenizer_round_trip(tokenizer, spec):
    text = "def f(x):\n    return x + 1  # café\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == spec.vocab_size
    assert len(ids) < len(text.encode())  # merges were learned
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {T.BOS, T.EOS, T.PAD}


def test_config_is_plain_deepseek_v3(tokenizer, spec):
    cfg = T.make_config(spec, tokenizer)
    assert cfg.model_type == "deepseek_v3" and cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert (cfg.n_group, cfg.topk_group) == (1, 1)
    assert cfg.q_lora_rank == spec.q_lora_rank and cfg.kv_lora_rank == spec.kv_lora_rank
    assert cfg.eos_token_id == tokenizer.eos_token_id


def test_training_reduces_loss_and_is_deterministic(tokenizer, corpus, spec):
    cfg = T.make_config(spec, tokenizer)
    kw = dict(steps=6, batch_size=4, seq_len=16, lr=3e-3, seed=1, progress=False)
    r1 = T.train_target(cfg, tokenizer, corpus, **kw)
    r2 = T.train_target(cfg, tokenizer, corpus, **kw)
    assert r1.losses == r2.losses and r1.heldout_loss == r2.heldout_loss
    assert sum(r1.losses[-2:]) / 2 < r1.losses[0] - 0.1
    assert r1.num_params == sum(p.numel() for p in r1.model.parameters()) and r1.active_params < r1.num_params
    assert r1.heldout_ppl == pytest.approx(torch.tensor(r1.heldout_loss).exp().item(), rel=1e-6)
    r3 = T.train_target(cfg, tokenizer, corpus, **{**kw, "seed": 2})
    assert r3.losses != r1.losses


def test_training_resume_matches(tokenizer, corpus, spec, tmp_path):
    cfg = T.make_config(spec, tokenizer)
    kw = dict(steps=6, batch_size=2, seq_len=16, lr=3e-3, seed=0, progress=False)
    full = T.train_target(cfg, tokenizer, corpus, **kw)
    part = T.train_target(cfg, tokenizer, corpus, checkpoint_dir=tmp_path, stop_after=3, **kw)
    assert len(part.losses) == 3
    resumed = T.train_target(cfg, tokenizer, corpus, checkpoint_dir=tmp_path, **kw)
    assert resumed.resumed_from_step == 3
    assert resumed.losses == pytest.approx(full.losses, abs=1e-6)


def test_save_load_round_trip(saved):
    path, model, tok, result = saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg.get("rope_scaling") is None and cfg["dtype"] == "float32"
    assert cfg.get("num_nextn_predict_layers", 0) == 0
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
    loaded, tok2 = TL.load_target(path)
    x = torch.randint(3, 300, (2, 10))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits, loaded(input_ids=x).logits, atol=1e-6)
    assert tok2("import os\n")["input_ids"] == tok("import os\n")["input_ids"]
    assert tok2.eos_token_id == tok.eos_token_id
    assert len(result.losses) == 4


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TL.load_target(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.json"):
        TL.load_target(tmp_path)


@pytest.mark.vllm
def test_vllm_accepts_saved_config(saved):
    pytest.importorskip("vllm")
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    path = saved[0]
    cfg = get_config(str(path), trust_remote_code=False)
    assert cfg.model_type == "deepseek_v3" and cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert cfg.kv_lora_rank == json.loads((path / "config.json").read_text())["kv_lora_rank"]
    cls = ModelRegistry._try_load_model_cls("DeepseekV3ForCausalLM")
    assert cls is not None and cls.__name__ == "DeepseekV3ForCausalLM"


def test_deepened_target_computes_the_same_tokens_and_aux_states(tmp_path):
    import json

    from eagle3lab import target as T
    from eagle3lab.aux_states.hooks import target_forward_with_aux

    T.build_embedded_target(T.tiny_spec(train_steps=3), tmp_path / "orig", seed=0)
    T.deepen_target(tmp_path / "orig", tmp_path / "deep", num_layers=7)
    assert json.loads((tmp_path / "deep" / "config.json").read_text())["num_hidden_layers"] == 7
    orig, _ = TL.load_target(tmp_path / "orig")
    deep, _ = TL.load_target(tmp_path / "deep")
    assert len(deep.model.layers) == 7
    # the added layers are real layers (same shapes as the last one), not empty shells
    assert T.count_parameters(deep) > T.count_parameters(orig) + 2 * sum(p.numel() for p in orig.model.layers[-1].parameters())
    ids = torch.randint(0, orig.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    a = target_forward_with_aux(orig, ids, [1, 2, 4])
    b = target_forward_with_aux(deep, ids, [1, 2, 4])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux)
    with torch.no_grad():  # greedy decoding with the KV cache goes through the added layers' cache slots too
        ga = orig.generate(ids[:1], max_new_tokens=8, do_sample=False)
        gb = deep.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)
    with pytest.raises(ValueError, match="deepen only adds"):
        T.deepen_target(tmp_path / "orig", tmp_path / "x", num_layers=2)


def test_wrap_as_kimi_k25_keeps_the_weights_under_the_wrappers_prefix(tmp_path):
    import json

    from safetensors.torch import load_file

    from eagle3lab import target as T

    T.build_embedded_target(T.tiny_spec(train_steps=1), tmp_path / "inner", seed=0)
    out = T.wrap_as_kimi_k25(tmp_path / "inner", tmp_path / "kimi")
    cfg = json.loads((out / "config.json").read_text())
    inner = json.loads((tmp_path / "inner/config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert {k: cfg["text_config"][k] for k in ("hidden_size", "kv_lora_rank", "topk_method", "num_hidden_layers")} == {
        k: inner[k] for k in ("hidden_size", "kv_lora_rank", "topk_method", "num_hidden_layers")}
    assert cfg["image_token_id"] == cfg["media_placeholder_token_id"] < inner["vocab_size"]
    assert "media_proc_cfg" in json.loads((out / "preprocessor_config.json").read_text())
    a, b = load_file(tmp_path / "inner/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(b) == sorted("language_model." + k for k in a)
    assert all(torch.equal(a[k], b["language_model." + k]) for k in a)
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "inner/tokenizer.json").read_bytes()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama/config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a DeepSeek-V3-family"):
        T.wrap_as_kimi_k25(tmp_path / "llama", tmp_path / "x")


@pytest.mark.parametrize("family, arch, tied", [("gemma3_text", "Gemma3ForCausalLM", True),
                                                ("exaone4", "Exaone4ForCausalLM", False)])
def test_dense_families_build_train_and_round_trip(family, arch, tied, tokenizer, corpus, tmp_path):
    """The dense families keep their quirks (Gemma-3's scaled embeddings and tied head, Exaone-4's post-LN layers)
    and save under the architecture vLLM registers."""
    spec = T.tiny_spec(architecture=family, num_key_value_heads=2, head_dim=32, intermediate_size=256)
    cfg = T.make_config(spec, tokenizer)
    assert cfg.model_type == family and cfg.architectures == [arch] and cfg.tie_word_embeddings is tied
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 32 and cfg.hidden_size == spec.hidden_size
    r = T.train_target(cfg, tokenizer, corpus, steps=4, batch_size=2, seq_len=16, lr=3e-3, seed=0, progress=False)
    # dense: every parameter is active (the rough count leaves the norms' weights out)
    assert r.num_params == T.count_parameters(r.model) and 0.99 * r.num_params < r.active_params <= r.num_params
    T.save_target(r.model, tokenizer, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [arch] and saved["model_type"] == family
    loaded, _ = TL.load_target(tmp_path)
    x = torch.randint(3, 300, (1, 9))
    with torch.no_grad():
        assert torch.allclose(r.model(input_ids=x).logits, loaded(input_ids=x).logits, atol=1e-6)
    if family == "gemma3_text":  # the quirk 05's agreement is about: the model scales its embeddings itself
        emb = loaded.get_input_embeddings()
        assert torch.allclose(emb(x), emb.weight[x] * spec.hidden_size ** 0.5, rtol=1e-3)
