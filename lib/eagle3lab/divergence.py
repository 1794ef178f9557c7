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

"A few bf16 steps" is a rule of thumb: a 16-layer MoE in bf16 accumulates rounding through every layer, and a
router whose top-k scores are near-tied may pick another expert. ``precision_error`` measures the yardstick
instead: how far a low-precision forward of this target moves a float32 top-2 margin, over every position of
given sequences. A divergence whose float32 margin lies within that measured error is a tie the precision
cannot resolve.
"""

from __future__ import annotations

import bisect
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
    def argmax_side(self) -> str:
        """Which of the two tokens the float32 target itself picks: "a", "b" or "neither"."""
        return "a" if self.argmax == self.token_a else "b" if self.argmax == self.token_b else "neither"

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


@dataclass(frozen=True)
class PrecisionError:
    """How far a low-precision forward of the target strays from float32, position by position: the measured
    yardstick for a tie that precision cannot resolve."""

    dtype: str  # the low-precision model's dtype
    positions: int
    argmax_flips: int  # positions where the low-precision argmax is not float32's
    margin_errors: tuple[float, ...]  # sorted |margin_low - margin_32| of float32's two best tokens

    @property
    def flip_rate(self) -> float:
        """Share of positions where the low-precision forward picks another token than float32."""
        return self.argmax_flips / self.positions if self.positions else 0.0

    @property
    def largest(self) -> float:
        """The largest shift of a top-2 margin seen."""
        return self.margin_errors[-1] if self.margin_errors else 0.0

    def quantile(self, q: float) -> float:
        """The q-quantile of the margin shifts (nearest rank)."""
        if not self.margin_errors:
            return 0.0
        return self.margin_errors[min(len(self.margin_errors) - 1, max(0, math.ceil(q * len(self.margin_errors)) - 1))]

    def share_at_least(self, margin: float) -> float:
        """Share of positions whose margin the low-precision forward moved by ``margin`` or more."""
        if not self.margin_errors:
            return 0.0
        return (len(self.margin_errors) - bisect.bisect_left(self.margin_errors, margin)) / len(self.margin_errors)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (the per-position shifts are summarised, not listed)."""
        return {"dtype": self.dtype, "positions": self.positions, "argmax_flips": self.argmax_flips,
                "argmax_flip_rate": self.flip_rate, "margin_error_p50": self.quantile(0.5),
                "margin_error_p99": self.quantile(0.99), "margin_error_p999": self.quantile(0.999),
                "margin_error_max": self.largest}


@torch.no_grad()
def precision_error(
    model32: Any, model_low: Any, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
) -> PrecisionError:
    """Run both models over each whole sequence (prompt + continuation) and compare, at every position that
    predicts a continuation token, float32's two best tokens' margin with the low-precision model's margin of
    the same two tokens, and the two argmaxes.

    The two models must hold the same weights (``model32`` a float32 copy of ``model_low``; ``model_low`` may
    be float32 too, which measures nothing but run-to-run noise). One forward per sequence and model, no padding,
    so only precision differs. An engine's mismatch is one low-precision run against another (other kernels),
    each this far from float32, so the two can be up to about twice as far apart as measured here.
    """
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    if next(model32.parameters()).dtype != torch.float32:
        raise ValueError("model32 must be float32: it is the reference the error is measured against")
    device32, device_low = next(model32.parameters()).device, next(model_low.parameters()).device
    errors: list[float] = []
    flips = 0
    for seq, n in zip(sequences, prompt_lens, strict=True):
        if n < 1 or n >= len(seq):
            continue  # no continuation token to predict
        ids = torch.tensor([list(seq)])
        l32 = model32(input_ids=ids.to(device32), use_cache=False).logits[0, n - 1:-1].float()
        low = model_low(input_ids=ids.to(device_low), use_cache=False).logits[0, n - 1:-1].float().to(l32.device)
        top = torch.topk(l32, 2, dim=-1)
        pair = low.gather(1, top.indices)
        shift = ((pair[:, 0] - pair[:, 1]) - (top.values[:, 0] - top.values[:, 1])).abs()
        errors.extend(shift.tolist())
        flips += int((low.argmax(-1) != top.indices[:, 0]).sum())
    dtype = str(next(model_low.parameters()).dtype).removeprefix("torch.")
    return PrecisionError(dtype, len(errors), flips, tuple(sorted(errors)))


def summarise(
    divs: Sequence[Divergence], compared: int, ties_within: float = 4.0, error: PrecisionError | None = None,
    within_quantile: float = 0.999,
) -> dict[str, Any]:
    """The figures a report states: how many prompts differ, and how many of those part at a near tie.

    Two readings of "near tie": the rule of thumb (a margin within ``ties_within`` bf16 steps of the logits), and
    with a measured ``error``, a margin no larger than the ``within_quantile`` quantile of the margin shifts
    the low-precision forward showed (a high quantile rather than the maximum, which one outlier sets and which
    grows with the number of positions). Each divergence also gets the share of positions moved that far.
    """
    ties = [d for d in divs if d.margin <= ties_within * d.bf16_resolution]
    sides = [d.argmax_side for d in divs]
    out: dict[str, Any] = {
        "compared": compared,
        "differing_at_a_token": len(divs),
        "near_ties": len(ties),
        "ties_within_bf16_steps": ties_within,
        "largest_margin": max((d.margin for d in divs), default=None),
        "first_positions": sorted(d.position for d in divs),
        "argmax_is_a": sides.count("a"),
        "argmax_is_b": sides.count("b"),
        "argmax_is_neither": sides.count("neither"),
        "divergences": [d.to_dict() for d in divs],
    }
    if error is not None:
        yardstick = error.quantile(within_quantile)
        out |= {"precision_error": error.to_dict(), "yardstick_quantile": within_quantile, "yardstick": yardstick,
                "yardstick_share": error.share_at_least(yardstick),
                "within_measured_error": sum(d.margin <= yardstick for d in divs)}
        for rec, d in zip(out["divergences"], divs, strict=True):
            rec["share_moved_this_far"] = error.share_at_least(d.margin)
    return out
