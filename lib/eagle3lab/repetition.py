"""How repetitive a set of token sequences is: distinct n-grams and periodic loops.

A small target decoding greedily falls into loops (``self.append(self.append(...``), and a drafter
predicts a loop almost for free: acceptance measured on such text says more about the loop than about the
drafter. These statistics go beside every acceptance figure, together with a model-free baseline (the
prompt-lookup drafter of :func:`eagle3lab.speculate.ngram_predictions`).

A *loop* is a span that repeats with a period p (1 <= p <= ``max_period``): every token equals the token
p before it, for at least ``max(p, min_run)`` tokens in a row, so the pattern occurs at least twice in a row
(and a run of one repeated token counts only from ``min_run + 1`` copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eagle3lab.acceptance import SpecDecodeStats


def loop_spans(seq: Sequence[int], max_period: int = 32, min_run: int = 4) -> list[tuple[int, int, int]]:
    """(start, end, period) of every maximal periodic span of ``seq`` (end exclusive)."""
    x = np.asarray(list(seq), dtype=np.int64)
    spans = []
    for p in range(1, min(max_period, len(x) - 1) + 1):
        eq = np.concatenate([[False], x[p:] == x[:-p], [False]])
        d = np.diff(eq.astype(np.int8))
        starts, ends = np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]  # runs of eq in index space j = i - p
        for s, e in zip(starts, ends, strict=True):
            if e - s >= max(p, min_run):
                spans.append((int(s), int(e + p), p))  # tokens s .. e+p-1 are periodic
    return spans


def loop_mask(seq: Sequence[int], max_period: int = 32, min_run: int = 4) -> list[bool]:
    """Per token: does it lie inside a loop?"""
    mask = [False] * len(seq)
    for s, e, _ in loop_spans(seq, max_period, min_run):
        mask[s:e] = [True] * (e - s)
    return mask


def longest_loop(seq: Sequence[int], max_period: int = 32, min_run: int = 4) -> int:
    """Length in tokens of the longest loop (0 without one)."""
    return max((e - s for s, e, _ in loop_spans(seq, max_period, min_run)), default=0)


def distinct_ngrams(seqs: Sequence[Sequence[int]], n: int) -> float:
    """Distinct n-grams / n-grams, pooled over all sequences (1.0: nothing repeats; nan: no n-gram)."""
    grams = [tuple(s[i : i + n]) for s in seqs for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


@dataclass
class RepetitionStats:
    """Repetition and diversity of a set of sequences."""

    sequences: int
    tokens: int
    distinct_tokens: int
    distinct_2gram: float  # pooled over the set
    distinct_4gram: float  # pooled over the set
    distinct_4gram_within: float  # mean over sequences of each sequence's own ratio
    loop_fraction: float  # tokens inside loops / tokens
    longest_loop_median: float
    longest_loop_max: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def repetition_stats(seqs: Sequence[Sequence[int]], max_period: int = 32, min_run: int = 4) -> RepetitionStats:
    """Repetition statistics of ``seqs`` (for example the generated part of each sample)."""
    seqs = [list(s) for s in seqs if len(s)]
    if not seqs:
        raise ValueError("repetition_stats: no non-empty sequence")
    tokens = sum(len(s) for s in seqs)
    masks = [loop_mask(s, max_period, min_run) for s in seqs]
    longest = [longest_loop(s, max_period, min_run) for s in seqs]
    within = [distinct_ngrams([s], 4) for s in seqs if len(s) >= 4]
    return RepetitionStats(
        sequences=len(seqs), tokens=tokens, distinct_tokens=len({t for s in seqs for t in s}),
        distinct_2gram=distinct_ngrams(seqs, 2), distinct_4gram=distinct_ngrams(seqs, 4),
        distinct_4gram_within=float(np.mean(within)) if within else float("nan"),
        loop_fraction=sum(sum(m) for m in masks) / tokens,
        longest_loop_median=float(np.median(longest)), longest_loop_max=max(longest),
    )


def split_rounds_by_loops(
    sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], traces: Sequence[Any], k: int
) -> tuple[SpecDecodeStats, SpecDecodeStats]:
    """(counters of the rounds whose first drafted token lies inside a loop, counters of the others).

    ``traces``: one :class:`eagle3lab.speculate.DecodeTrace` per sequence (prompt + continuation).
    """
    inside, outside = SpecDecodeStats(), SpecDecodeStats()
    for seq, plen, tr in zip(sequences, prompt_lens, traces, strict=True):
        mask = loop_mask(seq)
        for r in tr.rounds:
            pos = min(plen + r.start, len(mask) - 1)
            (inside if mask[pos] else outside).record_round(k, r.accepted)
    return inside, outside


def degeneracy_reasons(tau: float, ngram_tau: float, loop_fraction: float) -> list[str]:
    """Why a mean acceptance length says more about repetition than about the drafter (empty: it does not).

    Two signs, either enough: a prompt-lookup drafter with no model gets at least half of the EAGLE-3 drafter's
    gain over 1 (copying explains much of the acceptance), or at least half the evaluated tokens lie in loops.
    """
    reasons = []
    if ngram_tau - 1 >= 0.5 * (tau - 1):
        reasons.append(f"a prompt-lookup drafter with no model reaches τ = {ngram_tau:.2f} against the drafter's {tau:.2f}")
    if loop_fraction >= 0.5:
        reasons.append(f"{loop_fraction:.0%} of the evaluated tokens lie inside loops")
    return reasons
