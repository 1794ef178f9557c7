"""extraction.aux_route (03's choice of aux-state source) on the transformers route: the reference engine's own
model with the hand-computed check; another engine is closed and the target loaded afresh; a capture that
disagrees with the hand computation stops 03."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3lab import target as T
from eagle3lab.aux_states import hooks as H
from eagle3lab.aux_states import route as X
from eagle3lab.engines import factory as EF

IDS = [1, 3, 4]
SAMPLES = [{"prompt_ids": [5, 9, 17, 3], "output_ids": [8, 2, 11]}]


def _params(extractor: str = "transformers"):
    return SimpleNamespace(data=SimpleNamespace(extractor=extractor),
                           engine=SimpleNamespace(device="cpu", tensor_parallel_size=1),
                           target=SimpleNamespace(trust_remote_code=False))


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    T.build_embedded_target(T.tiny_spec(train_steps=2), path, seed=0)
    return path


class ClosableEngine:
    closed = False

    def close(self):
        self.closed = True


def test_reference_engine_extracts_with_its_own_model(target_path, tmp_path):
    eng = EF.make_engine("reference", target_path, device="cpu")
    route = X.aux_route(_params(), eng, target_path, IDS, SAMPLES, tmp_path / "w", tmp_path / "logs")
    assert route.source is eng.model
    assert route.metrics["hidden.extractor"] == "transformers on cpu"
    assert 0 <= route.metrics["hidden.verify_max_rel_diff"] < H.AUX_AGREEMENT_TOL
    assert route.note.startswith("aux ids [1, 3, 4]: max |hooks - hand computation|")


def test_another_engine_is_closed_and_the_target_loaded(target_path, tmp_path):
    other = ClosableEngine()
    route = X.aux_route(_params(), other, target_path, IDS, SAMPLES, tmp_path / "w", tmp_path / "logs")
    assert other.closed and route.source.config.num_hidden_layers == 4
    assert route.metrics["hidden.verify_max_rel_diff"] < H.AUX_AGREEMENT_TOL


def test_disagreeing_capture_stops(target_path, tmp_path, monkeypatch):
    monkeypatch.setattr(X, "verify_aux_mapping", lambda *a, **k: 0.5)
    eng = EF.make_engine("reference", target_path, device="cpu")
    with pytest.raises(RuntimeError, match="disagrees with the hand computation"):
        X.aux_route(_params(), eng, target_path, IDS, SAMPLES, tmp_path / "w", tmp_path / "logs")
