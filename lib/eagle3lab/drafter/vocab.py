"""The draft vocabulary: the most frequent target tokens, and vLLM's maps between the two vocabularies.

``d2t[i]`` is the offset from draft id ``i`` to its target id (``target = i + d2t[i]``, vLLM's rule);
``t2d`` is a bool mask over the target vocabulary (vLLM ignores it when loading; training uses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target tokens as (d2t, t2d).

    d2t: LongTensor[draft_vocab_size], offsets such that target id = i + d2t[i] (draft ids sorted by
    target id, so the offsets are non-negative and non-decreasing). t2d: BoolTensor[V_target], True for
    target tokens in the draft vocabulary. Ties (and unseen tokens, when the data has fewer distinct
    tokens than the draft vocabulary) go to the lower target id, so the result is deterministic.
    """
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1:
        raise ValueError(f"token_counts must be 1-D over the target vocabulary, got shape {tuple(counts.shape)}")
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be between 1 and the target vocabulary ({vocab})")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft-vocabulary ids to target ids (vLLM's rule: target = i + d2t[i])."""
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor, missing: int = -100) -> torch.Tensor:
    """Map target ids to draft ids; tokens outside the draft vocabulary become ``missing``.

    Because draft ids are assigned in ascending target-id order, the draft id of a target token is the
    number of draft tokens below it: a cumulative sum of the mask.
    """
    t2d = t2d.to(target_ids.device)
    rank = torch.cumsum(t2d.long(), 0) - 1
    ids = rank[target_ids]
    return torch.where(t2d[target_ids], ids, torch.full_like(ids, missing))


def token_counts_from_sequences(sequences: Sequence[Sequence[int]] | Any, vocab_size: int) -> torch.Tensor:
    """Count token occurrences over sequences of target ids (lists or LongTensors)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        t = torch.as_tensor(seq, dtype=torch.long).flatten()
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise ValueError(f"token id out of range for a vocabulary of {vocab_size}: {int(t.min())}..{int(t.max())}")
        counts += torch.bincount(t, minlength=vocab_size)
    return counts



@dataclass
class VocabCoverage:
    """How much of the response tokens a draft vocabulary can emit at all: an upper bound on accuracy."""

    target_vocab: int
    draft_vocab: int
    distinct_tokens: int  # distinct tokens seen in the counted data
    coverage: float  # share of counted tokens inside the draft vocabulary


def vocab_coverage(token_counts: torch.Tensor, t2d: torch.Tensor) -> VocabCoverage:
    """Coverage of ``token_counts`` (over the target vocabulary) by the draft vocabulary ``t2d``."""
    counts = torch.as_tensor(token_counts)
    total = int(counts.sum())
    return VocabCoverage(
        target_vocab=counts.numel(), draft_vocab=int(t2d.sum()), distinct_tokens=int((counts > 0).sum()),
        coverage=float(counts[t2d.bool()].sum()) / total if total else float("nan"),
    )
