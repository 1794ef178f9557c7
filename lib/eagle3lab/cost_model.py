"""The cost model of EAGLE-3 decoding, measured in the engine: plain step, EAGLE-3 round, c, τ/c, speedup.

05 decodes the same B prompts (held-out prompts, the list repeated when it holds fewer than B) at once, for N new
tokens each with EOS ignored, once without and once with EAGLE-3, on warm engines (one untimed run of the same
batch first). Per batch B:

- **plain step** = wall time of the plain greedy decode / N;
- **EAGLE-3 round** = wall time of the EAGLE-3 decode / (drafts / B), drafts from vLLM's ``spec_decode_num_drafts``
  counter difference around that run (drafts count per request, so drafts / B is the rounds one request went
  through);
- **c** = round / step: what one round costs in plain steps;
- **τ** = 1 + accepted / drafts, from the counters of that same timed run;
- **ceiling** = τ / c: the speedup if every round delivered τ tokens to the output;
- **measured speedup** = EAGLE-3 output tokens/s over plain output tokens/s.

Because all come from the same two runs, measured / ceiling = (T_e / T_p) · B·N / (drafts + accepted): with the
same tokens on both sides (EOS ignored), it is the output's tokens over the tokens the rounds made. vLLM's
prefill makes each request's first token outside any round (the ratio rises by about N / (N − 1)), and tokens a
round accepts past N are dropped (it falls). A gap between the two is therefore read from the counters; the
time itself sits in c, and :class:`CostRow` splits the round: the plain step, the verify pass's extra over it
(the target's forward over k + 1 tokens per request against one, timed inside the engine's worker where the
engine runs that forward in Python), our drafter module's k chained forwards timed in this process on the
engine's device and dtype (vLLM's proposer runs its own kernels and bookkeeping: excluded), and the remainder,
vLLM's proposer bookkeeping, rejection sampling and scheduling.

The worker functions (:func:`install_forward_timer` and the two after it) travel to vLLM's workers pickled by
reference, so this module's imports stay light: torch and the drafter package (torch only), and plotly only inside
:meth:`CostModel.figure`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3lab.drafter.vocab import draft_to_target
from eagle3lab.engines.base import DecodeTiming

# Measured and ceiling further apart than this (relative) get their gap explained on the page (issue 36).
GAP_TOLERANCE = 0.10


# ---------------------------------------------------------------------------------------------------------
# the arithmetic


def batch_prompts(prompts: Sequence[Sequence[int]], batch: int) -> list[list[int]]:
    """The first ``batch`` prompts, the list repeated from its start when it holds fewer."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not prompts:
        raise ValueError("no prompts to build a batch from")
    return [list(prompts[i % len(prompts)]) for i in range(batch)]


def step_seconds(wall_s: float, new_tokens: int) -> float:
    """Plain step: the wall time of a plain decode over the ``new_tokens`` tokens each request made."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    return wall_s / new_tokens


def round_seconds(wall_s: float, num_drafts: int, batch: int) -> float:
    """EAGLE-3 round: the wall time of an EAGLE-3 decode over the rounds per request (``num_drafts / batch``)."""
    if num_drafts < 1:
        raise ValueError("no drafts counted: the run made no EAGLE-3 round")
    return wall_s / (num_drafts / batch)


def ceiling(tau: float, c: float) -> float:
    """τ / c: the speedup if every round, costing c plain steps, delivered τ tokens."""
    return tau / c


def relative_gap(measured: float, ceiling_value: float) -> float:
    """measured / ceiling − 1 (negative: below the ceiling)."""
    return measured / ceiling_value - 1.0


def needs_explanation(measured: float, ceiling_value: float, tolerance: float = GAP_TOLERANCE) -> bool:
    """Whether measured speedup and ceiling differ by more than ``tolerance`` (relative to the ceiling)."""
    return abs(relative_gap(measured, ceiling_value)) > tolerance


def forward_summary(records: Sequence[tuple[int, float]], expected_tokens: int) -> tuple[float | None, str]:
    """The median seconds of the timed forwards over exactly ``expected_tokens`` tokens, and what it rests on.

    ``records``: (tokens, seconds) of every target forward of one instrumented run. Only forwards of the expected
    size are the step being measured (a prefill, a shrinking batch at the end, or a padded batch are not); with
    none of them, the forward is not measured and the note says what was seen instead.
    """
    match = [s for n, s in records if n == expected_tokens]
    if match:
        return statistics.median(match), f"median of {len(match)} forwards of {expected_tokens} tokens"
    sizes = sorted({n for n, _ in records})
    seen = (f"{len(records)} forwards of {', '.join(map(str, sizes[:6]))}{' ...' if len(sizes) > 6 else ''} tokens"
            if records else "no forward at all")
    return None, (f"not measured: no target forward of exactly {expected_tokens} tokens reached Python ({seen}); "
                  "an engine that replays its steps as CUDA graphs or pads its batches runs none that can be timed "
                  "from outside without changing it")


# ---------------------------------------------------------------------------------------------------------
# one batch


@dataclass
class CostRow:
    """One batch size: the plain and the EAGLE-3 timed runs, and our drafter's chain at that batch."""

    plain: DecodeTiming
    eagle3: DecodeTiming
    drafter_seconds: float | None = None  # k chained forwards of our drafter module, in process (None: not timed)

    def __post_init__(self) -> None:
        if self.plain.batch != self.eagle3.batch or self.plain.new_tokens != self.eagle3.new_tokens:
            raise ValueError(f"plain ({self.plain.batch} x {self.plain.new_tokens}) and EAGLE-3 "
                             f"({self.eagle3.batch} x {self.eagle3.new_tokens}) runs differ in batch or tokens")
        if self.eagle3.stats is None or not self.eagle3.num_speculative_tokens:
            raise ValueError("the EAGLE-3 run carries no spec-decode counters")

    @property
    def batch(self) -> int:
        """B."""
        return self.plain.batch

    @property
    def k(self) -> int:
        """Draft tokens per round."""
        return self.eagle3.num_speculative_tokens

    @property
    def step_s(self) -> float:
        """Plain step seconds."""
        return step_seconds(self.plain.seconds, self.plain.new_tokens)

    @property
    def round_s(self) -> float:
        """EAGLE-3 round seconds."""
        return round_seconds(self.eagle3.seconds, self.eagle3.stats.num_drafts, self.batch)

    @property
    def c(self) -> float:
        """Round / step."""
        return self.round_s / self.step_s

    @property
    def tau(self) -> float:
        """Mean acceptance length of the timed EAGLE-3 run."""
        return float(self.eagle3.stats.mean_acceptance_length)

    @property
    def ceiling(self) -> float:
        """τ / c."""
        return ceiling(self.tau, self.c)

    @property
    def speedup(self) -> float:
        """EAGLE-3 output tokens/s over plain output tokens/s."""
        return self.eagle3.tokens_per_s / self.plain.tokens_per_s

    @property
    def gap(self) -> float:
        """measured / ceiling − 1."""
        return relative_gap(self.speedup, self.ceiling)

    @property
    def explain(self) -> bool:
        """Measured and ceiling differ by more than :data:`GAP_TOLERANCE`."""
        return needs_explanation(self.speedup, self.ceiling)

    @property
    def tokens_per_round(self) -> float:
        """Output tokens per request per round: what τ would be if the output kept exactly the rounds' tokens."""
        return self.eagle3.output_tokens / self.eagle3.stats.num_drafts

    @property
    def verify_extra_s(self) -> float | None:
        """The target's forward over k + 1 tokens per request less its forward over one (None: either not timed)."""
        v, p = self.eagle3.forward_seconds, self.plain.forward_seconds
        return v - p if v is not None and p is not None else None

    @property
    def remainder_s(self) -> float | None:
        """round − step − verify extra (when measured) − drafter: vLLM's proposer bookkeeping, rejection sampling
        and scheduling (and, where the verify pass is not measured, its extra cost too). None without the drafter."""
        if self.drafter_seconds is None:
            return None
        return self.round_s - self.step_s - (self.verify_extra_s or 0.0) - self.drafter_seconds

    def metrics(self) -> dict[str, Any]:
        """The row as JSON-able numbers (milliseconds for times; None where not measured)."""
        st = self.eagle3.stats

        def ms(s: float | None) -> float | None:
            return None if s is None else s * 1e3

        return {"batch": self.batch, "new_tokens": self.plain.new_tokens, "k": self.k,
                "plain_seconds": self.plain.seconds, "eagle3_seconds": self.eagle3.seconds,
                "plain_tokens": self.plain.output_tokens, "eagle3_tokens": self.eagle3.output_tokens,
                "plain_tokens_per_s": self.plain.tokens_per_s, "eagle3_tokens_per_s": self.eagle3.tokens_per_s,
                "num_drafts": st.num_drafts, "num_accepted_tokens": st.num_accepted_tokens,
                "plain_step_ms": ms(self.step_s), "eagle3_round_ms": ms(self.round_s), "c": self.c, "tau": self.tau,
                "ceiling": self.ceiling, "measured_speedup": self.speedup, "gap": self.gap, "explained": self.explain,
                "tokens_per_round": self.tokens_per_round,
                "plain_forward_ms": ms(self.plain.forward_seconds), "verify_forward_ms": ms(self.eagle3.forward_seconds),
                "verify_extra_ms": ms(self.verify_extra_s), "drafter_ms": ms(self.drafter_seconds),
                "remainder_ms": ms(self.remainder_s)}


def _ms(s: float | None, digits: int = 2) -> str:
    return "not measured" if s is None else f"{s * 1e3:.{digits}f}"


# ---------------------------------------------------------------------------------------------------------
# the section


@dataclass
class CostModel:
    """The cost model over every measured batch, or why there is none (``status``)."""

    k: int
    rows: list[CostRow] = field(default_factory=list)
    status: str = "measured"
    drafter_note: str = ""  # where and how the drafter was timed
    verify_note: str = ""  # how the verify pass was timed, or why not
    seconds: dict[str, float] = field(default_factory=dict)  # this section's own time, for 05's timing table

    @property
    def measured(self) -> bool:
        """Whether any batch was timed."""
        return bool(self.rows)

    def table_rows(self) -> list[dict[str, Any]]:
        """Step, round, c, τ, ceiling and measured speedup side by side, one row per batch."""
        return [{"batch": r.batch, "plain step ms": round(r.step_s * 1e3, 3), "EAGLE-3 round ms": round(r.round_s * 1e3, 3),
                 "c = round / step": round(r.c, 3), "τ": round(r.tau, 3), "ceiling τ / c": round(r.ceiling, 3),
                 "measured speedup": round(r.speedup, 3), "measured / ceiling − 1": f"{r.gap:+.1%}",
                 "tokens/s plain / EAGLE-3": f"{r.plain.tokens_per_s:,.0f} / {r.eagle3.tokens_per_s:,.0f}"}
                for r in self.rows]

    def breakdown_rows(self) -> list[dict[str, Any]]:
        """Where a round's time goes, per batch (ms)."""
        return [{"batch": r.batch, "EAGLE-3 round": _ms(r.round_s), "plain step (the step-equivalent)": _ms(r.step_s),
                 "target forward, 1 token per request": _ms(r.plain.forward_seconds),
                 "target forward, k+1 tokens per request": _ms(r.eagle3.forward_seconds),
                 "verify extra: the difference": _ms(r.verify_extra_s),
                 "drafter: our module, k chained forwards": _ms(r.drafter_seconds),
                 "remainder: vLLM's proposer, rejection sampling, scheduling"
                 + ("" if r.verify_extra_s is not None else " (+ verify extra)"): _ms(r.remainder_s)}
                for r in self.rows]

    def caption(self) -> str:
        """Caption of the side-by-side table."""
        if not self.rows:
            return self.status
        r = self.rows[0]
        return (f"B prompts decoded at once, {r.plain.new_tokens} new tokens each (EOS ignored), warm engines, k = "
                f"{self.k}; τ from vLLM's counters of the timed EAGLE-3 run")

    def metrics(self) -> dict[str, Any]:
        """``acceptance.cost_model`` (one dict per batch, keyed by the batch as text; empty when not measured) and
        ``acceptance.cost_model_status``."""
        return {"acceptance.cost_model": {str(r.batch): r.metrics() for r in self.rows},
                "acceptance.cost_model_status": self.status}

    def figure(self) -> Any:
        """Per batch, the plain step beside the EAGLE-3 round split into its measured parts (ms)."""
        import plotly.graph_objects as go

        x = [[f"batch {r.batch}" for r in self.rows for _ in (0, 1)], ["plain step", "EAGLE-3 round"] * len(self.rows)]

        def pair(round_part: Any) -> list[float | None]:
            out: list[float | None] = []
            for r in self.rows:
                v = round_part(r)
                out += [0.0, None if v is None else v * 1e3]
            return out

        fig = go.Figure()
        fig.add_bar(x=x, y=[v for r in self.rows for v in (r.step_s * 1e3, r.step_s * 1e3)],
                    name="target step (plain decoding)")
        fig.add_bar(x=x, y=pair(lambda r: r.verify_extra_s), name="verify extra (k+1 vs 1 token)")
        fig.add_bar(x=x, y=pair(lambda r: r.drafter_seconds), name="drafter (our module, in process)")
        fig.add_bar(x=x, y=pair(lambda r: r.remainder_s), name="remainder (proposer, rejection sampling, scheduling)")
        for r in self.rows:
            # above the round's bar, whose stack exceeds the round's time where the remainder is negative
            top = r.step_s + max(r.verify_extra_s or 0.0, 0.0) + max(r.drafter_seconds or 0.0, 0.0)
            fig.add_annotation(x=[f"batch {r.batch}", "EAGLE-3 round"], y=max(r.round_s, top) * 1e3, yshift=18,
                               showarrow=False, font={"size": 11},
                               text=f"c = {r.c:.2f}<br>τ/c {r.ceiling:.2f}x, measured {r.speedup:.2f}x")
        fig.update_layout(barmode="relative", title="Where a round's time goes, per batch (measured)",
                          yaxis_title="ms", legend={"orientation": "h", "y": -0.25})
        return fig

    def note(self) -> str:
        """The section's sentences: the figures per batch, the batches whose gap needs explaining and where the
        round's time goes, and what the drafter and verify timings rest on."""
        if not self.rows:
            return f"**{self.status[:1].upper()}{self.status[1:]}.**"
        parts = ["; ".join(f"batch {r.batch}: c = {r.c:.2f}, τ = {r.tau:.2f}, ceiling τ/c = {r.ceiling:.2f}x, "
                           f"measured **{r.speedup:.2f}x**" for r in self.rows) + "."]
        for r in self.rows:
            parts.append(self._batch_text(r))
        parts.append(self.drafter_note)
        parts.append(self.verify_note)
        return "\n\n".join(p for p in parts if p)

    @staticmethod
    def _batch_text(r: CostRow) -> str:
        st = r.eagle3.stats
        made = st.num_drafts + st.num_accepted_tokens
        dropped = made + r.batch - r.eagle3.output_tokens
        head = (f"**Batch {r.batch}: measured {r.speedup:.2f}x and ceiling {r.ceiling:.2f}x differ by {r.gap:+.0%}.** "
                "Both come from the same two runs, so their ratio is a count, not a time: (EAGLE-3 tokens / plain "
                f"tokens) x B·N / (drafts + accepted) = {r.speedup / r.ceiling:.3f}. The {st.num_drafts} rounds made "
                f"{made} tokens (τ = {r.tau:.2f}), the prefill {r.batch} more (each request's first token), and the "
                f"output kept {r.eagle3.output_tokens} ({r.tokens_per_round:.2f} per request per round): "
                + (f"{dropped} tokens made past {r.eagle3.new_tokens} per request were dropped. " if dropped > 0 else
                   "the prefill's tokens are the whole gap. ")
                if r.explain else
                f"Batch {r.batch}: measured within {GAP_TOLERANCE:.0%} of the ceiling ({r.gap:+.1%}). ")
        split = [f"plain step {_ms(r.step_s)} ms"]
        split.append(f"verify extra {_ms(r.verify_extra_s)}" + (" ms" if r.verify_extra_s is not None else ""))
        split.append(f"drafter {_ms(r.drafter_seconds)}" + (" ms" if r.drafter_seconds is not None else ""))
        if r.remainder_s is not None:
            split.append(f"remainder {_ms(r.remainder_s)} ms ("
                         + ("vLLM's proposer, rejection sampling and scheduling" if r.verify_extra_s is not None else
                            "vLLM's proposer, rejection sampling, scheduling and the verify pass's extra") + ")")
        negative = (" The remainder is negative: our in-process drafter timing exceeds what the round spends beyond "
                    "the step and the verify extra, so here it is no measure of vLLM's drafter (eager PyTorch against "
                    "vLLM's kernels, or a machine busy with other work) and the round's split is not resolved."
                    if r.remainder_s is not None and r.remainder_s < 0 else "")
        return (head + f"Where the round's {_ms(r.round_s)} ms go (c = {r.c:.2f}: a round costs {r.c - 1:+.2f} "
                "plain steps beyond one): " + ", ".join(split) + "." + negative)


def not_measured(k: int, engine_kind: str) -> CostModel:
    """The section for an engine that does not time its runs."""
    why = ("not measured on the reference engine (it recomputes whole sequences without a KV cache: its wall time "
           "is no measure of speed)" if engine_kind == "reference" else
           f"not measured: the {engine_kind} engine does not time batches")
    return CostModel(k, status=why)


# ---------------------------------------------------------------------------------------------------------
# our drafter's forward, in process


@torch.no_grad()
def drafter_chain_seconds(drafter: Any, batch: int, k: int, context_len: int, *, repeats: int = 10,
                          warmup: int = 2) -> float:
    """Median wall seconds of one round's drafting by our drafter module at ``batch``: k chained forwards.

    As vLLM's EAGLE proposer runs them: a first forward over the verify step's k + 1 positions per request (fc over
    the aux states, the decoder layer, the draft head at the last position), then k − 1 one-token forwards, each
    fed the last pre-norm state and drafted token, all attending ``context_len`` cached positions. Inputs are random
    (a dense drafter's cost does not depend on values). This is the drafter's math on the drafter's device and dtype
    in eager PyTorch; vLLM's proposer bookkeeping (input preparation, its attention metadata, CUDA graphs) is not
    in it.
    """
    if batch < 1 or k < 1 or context_len < 1:
        raise ValueError(f"batch, k and context_len must be >= 1, got {batch}, {k}, {context_len}")
    cfg = drafter.config
    w = drafter.fc.weight
    dev, dtype = w.device, w.dtype
    width = cfg.num_aux * cfg.target_hidden_size

    def ids(t: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (batch, t), device=dev)

    def positions(start: int, t: int) -> torch.Tensor:
        return torch.arange(start, start + t, device=dev)[None].expand(batch, t)

    def sync() -> None:  # CUDA kernels run asynchronously: wait for them before reading the clock
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    aux_ctx = torch.randn(batch, context_len, width, device=dev, dtype=dtype)
    _, _, kv_ctx = drafter.step(ids(context_len), drafter.combine_hidden_states(aux_ctx), positions(0, context_len), [])
    aux = torch.randn(batch, k + 1, width, device=dev, dtype=dtype)
    first_ids, first_pos = ids(k + 1), positions(context_len, k + 1)
    sees_context = torch.ones(batch, k + 1, context_len, dtype=torch.bool, device=dev)

    def chain() -> None:
        normed, prenorm, kv = drafter.step(first_ids, drafter.combine_hidden_states(aux), first_pos, [kv_ctx],
                                           sees_context)
        tok = draft_to_target(drafter.logits(normed[:, -1:]).argmax(-1), drafter.d2t)
        cache = [kv_ctx, (kv[0][:, :, -1:], kv[1][:, :, -1:])]  # later steps attend the chain's own last key
        hidden = prenorm[:, -1:]
        for j in range(1, k):
            normed, hidden, kv = drafter.step(tok, hidden, positions(context_len + k + j, 1), cache,
                                              sees_context[:, -1:])
            cache.append(kv)
            tok = draft_to_target(drafter.logits(normed).argmax(-1), drafter.d2t)

    for _ in range(warmup):
        chain()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        chain()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drafter_round_seconds(drafter: Any, batch: int, k: int, context_len: int, *,
                          repeats: int = 10) -> tuple[float, int | None]:
    """:func:`drafter_chain_seconds`, and on a CPU the CPU threads it ran with (None on another device).

    On a CPU it is the faster of torch's own thread count and one thread: OpenMP threads on cores that other work
    holds wait on each other (the same 0.3M-parameter chain took 200 ms with 2 threads and 6 ms with 1 on the 2-core
    CI machine while another job ran, 2026-12-07), whereas vLLM's CPU worker pins its threads to cores of its own.
    """
    if drafter.fc.weight.device.type != "cpu":
        return drafter_chain_seconds(drafter, batch, k, context_len, repeats=repeats), None
    threads = torch.get_num_threads()
    best = (drafter_chain_seconds(drafter, batch, k, context_len, repeats=repeats), threads)
    if threads > 1:
        try:
            torch.set_num_threads(1)
            best = min(best, (drafter_chain_seconds(drafter, batch, k, context_len, repeats=repeats), 1))
        finally:
            torch.set_num_threads(threads)
    return best


def drafter_for_timing(drafter: Any, device: str, dtype: str) -> Any:
    """A copy of ``drafter`` on ``device`` in ``dtype`` (a torch dtype name such as ``bfloat16``), in eval mode."""
    import copy

    return copy.deepcopy(drafter).to(device=torch.device(device), dtype=getattr(torch, dtype)).eval()


# ---------------------------------------------------------------------------------------------------------
# the target's forward, timed inside vLLM's worker (through LLM.apply_model)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _num_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    # vLLM calls the model with input_ids (or inputs_embeds) and positions, by keyword or in that order.
    for name, pos in (("input_ids", 0), ("inputs_embeds", None), ("positions", 1)):
        x = kwargs.get(name, args[pos] if pos is not None and len(args) > pos else None)
        if isinstance(x, torch.Tensor):
            return int(x.shape[0] if name == "inputs_embeds" else x.shape[-1])
    return -1


def install_forward_timer(model: Any) -> dict[str, Any]:
    """Run in a vLLM worker: wrap ``model.forward`` so that every call is timed (synchronised on CUDA) and kept as
    (tokens, seconds). Idempotent (a second install resets the records). Returns the worker's rank, device and
    dtype, which the in-process drafter timing then uses."""
    import torch.distributed as dist

    p = next(model.parameters())
    info = {"rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
            "device": p.device.type, "dtype": str(p.dtype).removeprefix("torch.")}
    if "_e3_forward_times" in model.__dict__:
        model._e3_forward_times = []  # noqa: SLF001
        return info
    model._e3_forward_prev = model.__dict__.get("forward")  # noqa: SLF001  (an instance wrapper already there)
    original = model.forward
    model._e3_forward_times = []  # noqa: SLF001

    def forward(*args: Any, **kwargs: Any) -> Any:
        _sync()  # the previous step's kernels are not this forward's
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        _sync()
        model._e3_forward_times.append((_num_tokens(args, kwargs), time.perf_counter() - t0))  # noqa: SLF001
        return out

    model.forward = forward
    return info


def drain_forward_timer(model: Any) -> list[tuple[int, float]]:
    """Run in a vLLM worker: the (tokens, seconds) timed since the install or the last drain (rank 0 only)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return []
    out = list(model.__dict__.get("_e3_forward_times", []))
    model._e3_forward_times = []  # noqa: SLF001
    return out


def remove_forward_timer(model: Any) -> int:
    """Run in a vLLM worker: put back the forward that was there before the install."""
    if "_e3_forward_times" not in model.__dict__:
        return 1
    prev = model.__dict__.pop("_e3_forward_prev", None)
    model.__dict__.pop("_e3_forward_times", None)
    if prev is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = prev
    return 1
