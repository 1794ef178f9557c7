"""provenance.guard: a resumable step never resumes from other inputs; it rebuilds or refuses, naming them."""

from __future__ import annotations

import pytest

from eagle3lab import provenance


def test_guard_rebuilds_or_refuses_and_names_what_changed(tmp_path):
    out = tmp_path / "samples.jsonl"
    assert provenance.guard(tmp_path, {"target": "A", "n": 4}, [out]) == []  # new folder
    out.write_text("made from A\n")
    assert provenance.guard(tmp_path, {"target": "A", "n": 4}, [out]) == [] and out.is_file()  # same inputs: kept
    with pytest.raises(provenance.StaleArtifactError, match="target changed"):
        provenance.guard(tmp_path, {"target": "B", "n": 4}, [out], on_stale="refuse")
    assert out.is_file()  # refusing deletes nothing
    assert provenance.guard(tmp_path, {"target": "B", "n": 4}, [out]) == ["target"]
    assert not out.exists()  # rebuilt: the stale output is gone, the new record is written
    assert provenance.guard(tmp_path, {"target": "B", "n": 4}, [out]) == []


def test_outputs_without_a_record_are_stale(tmp_path):
    out = tmp_path / "train_state.pt"
    out.write_bytes(b"old")  # written before records existed: nothing says what it was made from
    assert provenance.guard(tmp_path, {"config": 1}, [out]) == ["config"] and not out.exists()


def test_model_fingerprint_tells_weights_apart():
    torch = pytest.importorskip("torch")
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    assert provenance.model_fingerprint(a) == provenance.model_fingerprint(a)
    assert provenance.model_fingerprint(a) != provenance.model_fingerprint(b)
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
    assert provenance.model_fingerprint(a) == provenance.model_fingerprint(b)
