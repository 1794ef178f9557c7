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


def test_samples_of_another_target_are_regenerated(tmp_path):
    """synthetic.generate_samples resumes only samples made by the same engine with the same settings."""
    torch = pytest.importorskip("torch")
    from eagle3lab import synthetic

    class FakeEngine:
        def __init__(self, token: int) -> None:
            torch.manual_seed(token)
            self.model, self.token = torch.nn.Linear(2, 2), token  # the weights it "generates" with

        def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
            return [[self.token] * max_new_tokens for _ in prompts]

    prompts = [[3, 4], [5, 6, 7]]
    path = synthetic.generate_samples(FakeEngine(11), prompts, tmp_path, 2, progress=False)
    assert {tuple(s["output_ids"]) for s in synthetic.read_samples(path)} == {(11, 11)}
    synthetic.generate_samples(FakeEngine(11), prompts, tmp_path, 2, progress=False)  # same inputs: resumed
    assert len(synthetic.read_samples(path)) == 2
    synthetic.generate_samples(FakeEngine(12), prompts, tmp_path, 2, progress=False)  # another target
    assert {tuple(s["output_ids"]) for s in synthetic.read_samples(path)} == {(12, 12)}
    synthetic.generate_samples(FakeEngine(12), prompts, tmp_path, 3, progress=False)  # other settings
    assert {tuple(s["output_ids"]) for s in synthetic.read_samples(path)} == {(12, 12, 12)}


def test_target_training_never_resumes_other_settings(tmp_path):
    pytest.importorskip("torch")
    from eagle3lab import target

    spec = target.tiny_spec()
    corpus = target.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)
    tok = target.train_tokenizer(corpus, spec.vocab_size)
    cfg = target.make_config(spec, tok)
    kw = dict(steps=4, batch_size=2, seq_len=16, seed=0, progress=False, checkpoint_dir=tmp_path)
    target.train_target(cfg, tok, corpus, lr=3e-3, stop_after=2, **kw)
    assert target.train_target(cfg, tok, corpus, lr=3e-3, stop_after=3, **kw).resumed_from_step == 2
    assert target.train_target(cfg, tok, corpus, lr=1e-3, **kw).resumed_from_step == 0  # another schedule
