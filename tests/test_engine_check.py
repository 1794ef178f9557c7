"""03's check of the in-engine route (``route.check_engine_capture``): stored aux states against transformers'.

The stored shards here come from our transformers extraction (the same file format the engine route writes); a
store whose ids are shifted by one layer, as a wrong engine mapping would give, must fail the check.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lab import target as T
from eagle3lab.aux_states import shards as H
from eagle3lab.aux_states.route import check_engine_capture


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    spec = T.tiny_spec(corpus_max_bytes=20_000)
    tok = T.train_tokenizer(T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction), spec.vocab_size)
    cfg = T.make_config(spec, tok)
    cfg.initializer_range = 0.2  # neighbouring layers' streams far apart, so that a shift shows
    model = T.build_model(cfg, seed=0).eval()
    T.save_target(model, tok, path)
    g = torch.Generator().manual_seed(0)
    samples = path / "samples.jsonl"
    with open(samples, "w") as f:
        for i in range(5):
            p = torch.randint(3, spec.vocab_size, (4 + i,), generator=g).tolist()
            o = torch.randint(3, spec.vocab_size, (3 + 2 * i,), generator=g).tolist()
            f.write(json.dumps({"id": i, "prompt_ids": p, "output_ids": o}) + "\n")
    return path, model, samples, cfg.num_hidden_layers


def test_a_right_store_passes(saved, tmp_path):
    path, model, samples, layers = saved
    ids = [1, 2, layers]
    H.extract_hidden_states(model, samples, ids, tmp_path / "h", progress=False)
    check = check_engine_capture(tmp_path / "h", path, 3, "cpu", "float32")
    assert check.passed, check
    assert check.sequences == 3 and sorted(check.per_id) == ids
    assert check.worst < 1e-5 and check.nearest_shifted > 0.05
    assert check.metrics()["hidden.engine_check_passed"] is True
    assert "within" in check.note()


def test_a_store_shifted_by_one_layer_fails(saved, tmp_path):
    path, model, samples, _ = saved
    H.extract_hidden_states(model, samples, [2, 3], tmp_path / "h", progress=False)
    manifest = tmp_path / "h" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["aux_layer_ids"] = [1, 2]  # what an engine that captured each layer's output instead of its input stores
    manifest.write_text(json.dumps(m))
    check = check_engine_capture(tmp_path / "h", path, 5, "cpu", "float32")
    assert not check.passed
    assert check.worst > 0.05
    assert "OUTSIDE" in check.note()


def test_bad_dtype_rejected(saved, tmp_path):
    path, *_ = saved
    with pytest.raises(ValueError, match="no tolerance"):
        check_engine_capture(tmp_path, path, 1, "cpu", "int8")
