"""Why a speculative output differs from plain greedy decoding: the target's own margin where they part.

EAGLE-3 at temperature 0 is lossless in exact arithmetic: every emitted token is the target's argmax. In bf16 an
engine computes the verification step (k + 1 positions at once) with other kernels and reduction orders than a
one-token decode step, so where the target's two best tokens are nearly tied, the two runs may pick different
ones, and every later token follows from that choice. A broken drafter path or patch looks different: it
diverges early, where the target is confident.

``divergence_margins`` tells the two apart. For every pair of outputs it finds the first differing token and
asks the target, in float32, how far apart the two candidates' logits are after the common prefix. A margin
within bf16's rounding of the logits (``bf16_resolution``) is a tie the engine could not resolve; a large
margin says one of the runs did not emit the target's argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Divergence:
    """Where one prompt's two outputs part, and the float32 target's view of the two tokens there."""

    prompt: int
    position: int  # index into the outputs of the first differing token
    token_a: int
    token_b: int
    logit_a: float
    logit_b: float
    argmax: int  # the float32 target's own choice after the common prefix
    top2_margin: float  # float32 logit of its best token minus its second best

    @property
    def margin(self) -> float:
        """|logit_a - logit_b|: how far apart the two runs' choices are for the float32 target."""
        return abs(self.logit_a - self.logit_b)

    @property
    def bf16_resolution(self) -> float:
        """Spacing of bf16 numbers at the size of these logits (8 significant bits): a margin below a few of
        these can flip under a different summation order."""
        scale = max(abs(self.logit_a), abs(self.logit_b), 1e-30)
        return 2.0 ** (math.floor(math.log2(scale)) - 7)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record, with the derived margin and resolution."""
        return {**asdict(self), "margin": self.margin, "bf16_resolution": self.bf16_resolution}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, None when the outputs are equal; a length difference (one run stopped
    earlier) parts at the shorter length."""
    if list(a) == list(b):
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def divergence_margins(
    model: Any, prompts: Sequence[Sequence[int]], outputs_a: Sequence[Sequence[int]],
    outputs_b: Sequence[Sequence[int]],
) -> list[Divergence]:
    """For each prompt whose two outputs differ at a token both have, the float32 logits of both tokens.

    ``model`` is the target (a transformers causal LM); it is run in float32 on its own device, one prefix at a
    time, so no padding or batching enters the numbers. Prompts whose outputs differ only in length (one run
    stopped early) are skipped: there is no pair of tokens to compare.
    """
    if not (len(prompts) == len(outputs_a) == len(outputs_b)):
        raise ValueError(f"{len(prompts)} prompts, {len(outputs_a)} and {len(outputs_b)} outputs: counts must agree")
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ValueError(f"the target must be float32 here (got {dtype}): the point is to measure past bf16")
    device = next(model.parameters()).device
    found: list[Divergence] = []
    for i, (p, a, b) in enumerate(zip(prompts, outputs_a, outputs_b, strict=True)):
        j = first_difference(a, b)
        if j is None or j >= min(len(a), len(b)):
            continue
        ids = torch.tensor([list(p) + list(a[:j])], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        top = torch.topk(logits, 2)
        found.append(Divergence(
            prompt=i, position=j, token_a=int(a[j]), token_b=int(b[j]), logit_a=float(logits[a[j]]),
            logit_b=float(logits[b[j]]), argmax=int(top.indices[0]),
            top2_margin=float(top.values[0] - top.values[1]),
        ))  # fmt: skip
    return found


def summarise(divs: Sequence[Divergence], compared: int, ties_within: float = 4.0) -> dict[str, Any]:
    """The figures a report states: how many prompts differ, and how many of those part at a near tie (a margin
    within ``ties_within`` bf16 steps of the logits)."""
    ties = [d for d in divs if d.margin <= ties_within * d.bf16_resolution]
    return {
        "compared": compared,
        "differing_at_a_token": len(divs),
        "near_ties": len(ties),
        "ties_within_bf16_steps": ties_within,
        "largest_margin": max((d.margin for d in divs), default=None),
        "first_positions": sorted(d.position for d in divs),
        "divergences": [d.to_dict() for d in divs],
    }
