"""What 05_acceptance computes, shows, records and says, one section at a time.

The notebook is the narrative: it calls these functions in order and displays what they return. Each
section has a function that runs it (with the engine, the reference decoder or the drafter) and a result
whose methods give the section's table rows, captions, sentences and metrics. Metrics are ``{key: value}``
in the order 05 records them (``record`` writes them into the run). Timings travel as ``seconds`` dicts
that the notebook merges into one table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from eagle3lab import acceptance as A
from eagle3lab import cost_model as CM
from eagle3lab import divergence as DV
from eagle3lab import probe as PR
from eagle3lab import repetition as R
from eagle3lab import speculate as SP
from eagle3lab import sweep as SW
from eagle3lab.acceptance import PromptIntervals, SpecDecodeStats
from eagle3lab.drafter import load_drafter
from eagle3lab.engines.factory import make_engine
from eagle3lab.repetition import RepetitionStats
from eagle3lab.synthetic import humaneval_prompts, read_jsonl, write_jsonl_atomic

RECORDS = A.RECORDS
TRAIN_TEXT = "training responses (03)"
EVAL_TEXT = "held-out greedy continuations"
# Published anchors for the HumanEval table: different models, prompts and engines (DESIGN.md, reference numbers).
PUBLISHED_TAU = (
    ("published: Kimi-K2/K2.5 EAGLE-3 drafters, SGLang, 3 steps (MT-bench, GSM8K, HumanEval, MATH500)", "2.4 – 3.5"),
    ("published: vLLM chain drafting, LLaMA-3.1-8B", "3.08 at k=4, 3.53 at k=7"),
    ("published: EAGLE-3 paper, LLaMA-3.1-8B, MT-bench, tree drafting", "6.13 (tree)"),
)


def record(wb: Any, metrics: Mapping[str, Any]) -> None:
    """Record every metric, in order, with ``wb.record`` (``wb``: a :class:`eagle3lab.workbook.Workbook`)."""
    for key, value in metrics.items():
        wb.record(key, value)


def interval_text(iv: A.Interval, digits: int = 3) -> str:
    """``value [lo, hi]`` with ``digits`` decimals."""
    return f"{iv.value:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


# ---------------------------------------------------------------------------------------------------------
# inputs and the records file


def heldout_prompts(path: Path, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` held-out prompts (token ids) that 03 wrote."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no held-out prompts (run 03_engine first)")
    return [r["prompt_ids"] for r in read_jsonl(path)][:num_prompts]


def setup_rows(num_prompts: int, k: int, max_new_tokens: int, engine_kind: str, drafter_path: Path) -> dict[str, Any]:
    """The table at the top of 05: what is measured, with which engine and drafter."""
    return {"held-out prompts": num_prompts, "k (num_speculative_tokens)": k, "max_new_tokens": max_new_tokens,
            "engine": engine_kind, "drafter": str(drafter_path)}


@dataclass
class Records:
    """``acceptance/records.jsonl`` of one notebook run: every prompt's rounds, per configuration."""

    path: Path
    prompts: list[list[int]]
    aux_layer_ids: list[int]  # the profile's drafter ("main")
    tokenizer: Any = None

    @classmethod
    def fresh(cls, path: Path, prompts: Sequence[Sequence[int]], aux_layer_ids: Sequence[int],
              tokenizer: Any = None) -> Records:
        """A records file written afresh by this run (an older one is deleted)."""
        path.unlink(missing_ok=True)
        return cls(path, [list(p) for p in prompts], list(aux_layer_ids), tokenizer)

    def add(self, traces: Sequence[Any] | None, *, k: int, temperature: float, split: str = "heldout",
            prompts: Sequence[Sequence[int]] | None = None, drafter: str = "main",
            aux_layer_ids: Sequence[int] | None = None, skip: Iterable[int] = ()) -> None:
        """Append one record per trace (none for an engine that reports no traces)."""
        if not traces:
            return
        A.write_records(self.path, A.records_for(
            traces, self.prompts if prompts is None else prompts, split=split, drafter=drafter,
            aux_layer_ids=self.aux_layer_ids if aux_layer_ids is None else aux_layer_ids, k=k,
            temperature=temperature, tokenizer=self.tokenizer, skip=skip), append=True)


# ---------------------------------------------------------------------------------------------------------
# speculative decoding with the engine


@dataclass
class EngineDecode:
    """The engine's greedy and speculative (T=0) decoding of the first ``decoded`` prompts."""

    decoded: int
    greedy: list[list[int]]
    spec: Any  # the engine's speculative result: outputs, stats, traces, per_prompt (and wall times, if any)
    seconds: dict[str, float] = field(default_factory=dict)
    # The first prompts decoded one at a time without speculation (engines that time their runs), else None.
    batch1_baseline: Any = None
    # The cost model's timed batches (eagle3lab.engines.base.DecodeTiming), plain and EAGLE-3, one per batch size, on
    # engines that time their runs; None elsewhere.
    cost_plain: list[Any] | None = None
    cost_eagle3: list[Any] | None = None

    @property
    def mismatch(self) -> list[int]:
        """Indices of the prompts whose speculative output differs from the greedy one."""
        return [i for i, (a, b) in enumerate(zip(self.greedy, self.spec.outputs, strict=True)) if a != b]

    @property
    def first_divergence(self) -> dict[int, int]:
        """For each mismatching prompt, the index of the first output token that differs (or the shorter length).

        Where the outputs part says what kind of mismatch it is: a bf16 near-tie flips one late token and the rest
        follows from it, while a broken drafter path or patch would diverge at the first tokens of most prompts.
        """
        return {i: DV.first_difference(self.greedy[i], self.spec.outputs[i]) for i in self.mismatch}

    @property
    def measured_speedup(self) -> float | None:
        """Baseline over speculative wall time, when the engine reported both (start-up excluded)."""
        base_s, spec_s = getattr(self.spec, "baseline_seconds", None), getattr(self.spec, "decode_seconds", None)
        return base_s / spec_s if base_s and spec_s else None

    @property
    def batch1(self) -> tuple[float, float] | None:
        """Output tokens/s at batch 1 without and with EAGLE-3, on the same first prompts (None: not timed)."""
        spec1 = getattr(self.spec, "batch1", None)
        if self.batch1_baseline is None or spec1 is None or not spec1.seconds:
            return None
        n = len(self.batch1_baseline.seconds)
        return self.batch1_baseline.tokens_per_s, spec1.first(n).tokens_per_s

    @property
    def measured_speedup_batch1(self) -> float | None:
        """EAGLE-3 over plain output tokens/s with prompts decoded one at a time (start-up excluded)."""
        b = self.batch1
        return b[1] / b[0] if b and b[0] > 0 else None

    def rows(self) -> dict[str, Any]:
        """The decode table: outputs against greedy decoding, and the counters."""
        mismatch, st = self.mismatch, self.spec.stats
        return {"prompts decoded": self.decoded, "outputs equal greedy decoding": not mismatch,
                "mismatching prompts": f"{len(mismatch)} of {self.decoded}"
                + (f" (indices {mismatch[:10]})" if mismatch else ""),
                **({"first differing token (min / median / max)": _spread(list(self.first_divergence.values()))}
                   if mismatch else {}),
                "drafts (rounds)": st.num_drafts, "accepted tokens": st.num_accepted_tokens,
                "τ": round(st.mean_acceptance_length, 3),
                **({f"wall time without / with EAGLE-3, {self.decoded} prompts at once":
                    f"{self.spec.baseline_seconds:.2f} s / {self.spec.decode_seconds:.2f} s "
                    f"({self.measured_speedup:.2f}x)"} if self.measured_speedup is not None else {}),
                **({f"tokens/s without / with EAGLE-3, one prompt at a time ({len(self.batch1_baseline.seconds)} prompts)":
                    f"{self.batch1[0]:,.0f} / {self.batch1[1]:,.0f} ({self.measured_speedup_batch1:.2f}x)"}
                   if self.measured_speedup_batch1 is not None else {})}

    def metrics(self) -> dict[str, Any]:
        """``acceptance.outputs_match_greedy``, ``decoded_prompts``, ``decoded_stats`` (and the measured speedup)."""
        out = {"acceptance.outputs_match_greedy": not self.mismatch, "acceptance.decoded_prompts": self.decoded,
               "acceptance.decoded_stats": self.spec.stats.to_dict(),
               "acceptance.mismatching_prompts": len(self.mismatch),
               "acceptance.first_divergence": {str(i): j for i, j in self.first_divergence.items()}}
        if self.measured_speedup is not None:
            out["acceptance.measured_speedup"] = self.measured_speedup
        if self.measured_speedup_batch1 is not None:
            base, spec = self.batch1  # set whenever the speedup is
            out |= {"acceptance.measured_speedup_batch1": self.measured_speedup_batch1,
                    "acceptance.batch1_prompts": len(self.batch1_baseline.seconds),
                    "acceptance.batch1_tokens_per_s": {"baseline": base, "eagle3": spec}}
        return out


def decode_with_engine(engine: Any, prompts: Sequence[Sequence[int]], drafter_path: Path, k: int,
                       max_new_tokens: int, decode_prompts: int | None, batch1_prompts: int,
                       cost_batches: Sequence[int] = ()) -> EngineDecode:
    """Greedy, then speculative decoding at T=0 of the first ``decode_prompts`` prompts (None: all).

    On an engine that times its runs (``time_batch1``), the first ``batch1_prompts`` of them are also decoded
    without speculation one at a time, while the plain engine is up; the speculative engine's per-prompt runs
    give the other side of the batch-1 speedup. On an engine that times batches (``time_decode``), each batch size
    of ``cost_batches`` is decoded at once (:func:`eagle3lab.cost_model.batch_prompts` of all ``prompts``) by the
    plain engine and then by the EAGLE-3 engine, each while it is up (vLLM starts one engine per speculative
    config), for :func:`cost_model`.
    """
    n = min(len(prompts), decode_prompts or len(prompts))
    t0 = time.perf_counter()
    greedy = engine.generate(prompts[:n], max_new_tokens)
    timer = getattr(engine, "time_batch1", None)
    base1 = timer(prompts[: min(n, batch1_prompts)], max_new_tokens) if callable(timer) else None
    batch_timer = getattr(engine, "time_decode", None)
    cost_s = 0.0
    cost_plain = cost_eagle3 = None
    if callable(batch_timer) and cost_batches:
        t1 = time.perf_counter()
        cost_plain = [batch_timer(CM.batch_prompts(prompts, b), max_new_tokens) for b in cost_batches]
        cost_s += time.perf_counter() - t1
    spec = engine.speculative_generate(prompts[:n], drafter_path, k, max_new_tokens)
    if cost_plain is not None:
        t1 = time.perf_counter()
        cost_eagle3 = [batch_timer(CM.batch_prompts(prompts, b), max_new_tokens, drafter_path, k) for b in cost_batches]
        cost_s += time.perf_counter() - t1
    seconds = {"decode T=0": time.perf_counter() - t0 - cost_s}
    if cost_plain is not None:
        seconds["cost model: timed batches"] = cost_s
    return EngineDecode(n, greedy, spec, seconds, base1, cost_plain, cost_eagle3)


def _spread(values: list[int]) -> str:
    """``min / median / max`` of token positions."""
    v = sorted(values)
    return f"{v[0]} / {statistics.median(v):g} / {v[-1]}"


@dataclass
class SampledDecode:
    """Speculative decoding with rejection sampling, per temperature, on the first ``prompts`` prompts."""

    prompts: int
    by_temperature: dict[float, Any]
    seconds: dict[str, float] = field(default_factory=dict)


def sample_with_engine(engine: Any, prompts: Sequence[Sequence[int]], drafter_path: Path, k: int,
                       max_new_tokens: int, temperatures: Sequence[float], sampled_prompts: int,
                       seed: int) -> SampledDecode:
    """Speculative decoding at each temperature (each above 0: T=0 is always measured) with a seeded sampler."""
    n = min(len(prompts), sampled_prompts)
    out = SampledDecode(n, {})
    for T in temperatures:
        if T <= 0:
            raise ValueError(f"acceptance.temperatures: {T} is not above 0 (temperature 0 is always measured)")
        t0 = time.perf_counter()
        out.by_temperature[T] = engine.speculative_generate(prompts[:n], drafter_path, k, max_new_tokens,
                                                            temperature=T, seed=seed)
        out.seconds[f"decode T={T:g}"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------------------
# the exact greedy replay on the reference decoder


def reference_engine(engine: Any, *, target_source: str, target_path: Path, device: str, dtype: str,
                     trust_remote_code: bool | None = None) -> Any | None:
    """An engine with the target in-process: ``engine`` itself, or for an embedded target a reference engine
    (after closing ``engine``: a vLLM engine holds the GPU); None for a checkpoint served by vLLM."""
    if hasattr(engine, "model"):
        return engine
    if target_source != "embedded":
        return None
    getattr(engine, "close", lambda: None)()
    return make_engine("reference", target_path, device, dtype, trust_remote_code=trust_remote_code)


def num_target_layers(ref: Any | None) -> int | None:
    """The in-process target's layer count (None without one)."""
    return int(ref.model.config.num_hidden_layers) if ref is not None else None


def k_values(k: int, max_k: int) -> list[int]:
    """The k of the τ-against-k curve: 1 .. max(max_k, k)."""
    return list(range(1, max(max_k, k) + 1))


@dataclass
class Replay:
    """Greedy continuations of the held-out prompts and the drafter's rounds on them for every k."""

    drafter: Any
    continuations: list[Any]  # eagle3lab.speculate.Continuation
    traces: dict[int, list[Any]]  # k -> one DecodeTrace per prompt
    seconds: dict[str, float] = field(default_factory=dict)

    def rows(self, ref: Any) -> dict[str, Any]:
        """What was replayed, on which reference, in how long."""
        s = self.seconds
        return {"prompts replayed": len(self.continuations), "reference": f"transformers, {ref.model.dtype}, {ref.device}",
                "seconds (continuations, replay)": f"{s['held-out continuations']:.1f}, {s['replay k=1..7']:.1f}"}

    def per_prompt(self, k: int) -> list[SpecDecodeStats]:
        """Each prompt's counters at ``k``."""
        return [t.stats for t in self.traces[k]]


def replay_heldout(ref: Any, drafter_path: Path, prompts: Sequence[Sequence[int]], ks: Sequence[int],
                   max_new_tokens: int, layer_ids: Sequence[int]) -> Replay:
    """Continue every prompt greedily (``max_new_tokens + max(ks)`` tokens, aux states of ``layer_ids``) and
    replay the drafter at every k in ``ks``."""
    drafter = load_drafter(drafter_path, ref.device)
    t0 = time.perf_counter()
    conts = SP.greedy_continuations(ref, prompts, max_new_tokens + max(ks), layer_ids, batch_size=64)
    t1 = time.perf_counter()
    traces = SP.replay_drafter(drafter, conts, ks, max_new_tokens, ref.eos_token_id)
    # The label names the default k range whatever ks is: it is the timing table's row name.
    return Replay(drafter, conts, traces, {"held-out continuations": t1 - t0, "replay k=1..7": time.perf_counter() - t1})


@dataclass
class ReplayCheck:
    """A check against the engine's decoded prompts (the replay's counters or rates, the divergences): its
    metrics, its sentence, and its table when it has one."""

    metrics: dict[str, Any]
    note: str
    rows: list[dict[str, Any]] | None = None  # engine vs reference, per position
    caption: str | None = None


def check_replay(traces: Sequence[Any], decode: EngineDecode, same_engine: bool, engine_kind: str) -> ReplayCheck:
    """Compare the replay's first ``decode.decoded`` traces (at the decoded k) with what the engine decoded.

    The same decoder must give equal counters prompt by prompt (counters, not rates: nan rates never compare
    equal). A real engine runs its own kernels in the profile's dtype: close, not equal, within a tolerance.
    """
    spec = decode.spec
    if same_engine:
        same = [r.stats == s for r, s in zip(traces[: decode.decoded], spec.per_prompt or [], strict=False)]
        return ReplayCheck({"acceptance.replay_matches_decoded": bool(same) and all(same)},
                           f"The exact replay equals the decoder's counters on {sum(same)} of {len(same)} prompts.")
    side = A.engine_vs_reference(spec.stats, sum(t.stats for t in traces[: decode.decoded]))
    return ReplayCheck(
        {"acceptance.engine_per_position": spec.stats.per_position_rate,
         "acceptance.reference_per_position": [r["reference"] for r in side.rows[:-1]],
         "acceptance.engine_reference_max_gap": side.max_gap,
         "acceptance.engine_reference_agree": side.agree},
        f"{engine_kind} and the reference decoder {'agree' if side.agree else 'DISAGREE'}: the largest gap "
        f"between their per-position rates is {side.max_gap:.3f} (tolerance {side.tolerance}). The figures "
        "below come from the reference's exact replay of all held-out prompts.",
        side.rows,
        f"acceptance per draft position on the same {decode.decoded} prompts and drafter: the {engine_kind} "
        f"engine's counters vs the reference decoder; tolerance {side.tolerance}",
    )


def replay_skip(kk: int, k: int, decode: EngineDecode) -> range | tuple[()]:
    """Prompt indices whose replay record to leave out at ``kk``: those the engine decoded at k (they keep their
    decoded record, so there is one record per configuration and prompt)."""
    return range(decode.decoded) if kk == k and decode.spec.traces else ()


def divergence_check(model: Any, prompts: Sequence[Sequence[int]], decode: EngineDecode) -> ReplayCheck | None:
    """Where each mismatching prompt's speculative output parts from greedy, the float32 target's logits of the
    two tokens there (``divergence.divergence_margins``); None when every output equals greedy decoding.

    ``model`` is the in-process target; a bf16 one is copied to float32 for this (the point is to look past
    bf16's rounding). A low-precision ``model`` also gives the measured yardstick
    (``divergence.precision_error``): how far its own forward moves float32's top-2 margins over the decoded
    prompts' greedy continuations. That is transformers' bf16, not the engine's kernels: the same precision,
    other reduction orders.
    """
    import copy

    import torch

    if not decode.mismatch:
        return None
    low = next(model.parameters()).dtype != torch.float32
    ref32 = copy.deepcopy(model).float() if low else model
    n = decode.decoded
    divs = DV.divergence_margins(ref32, prompts[:n], decode.greedy, decode.spec.outputs)
    error = None
    if low:
        seqs = [list(p) + list(g) for p, g in zip(prompts[:n], decode.greedy, strict=True)]
        error = DV.precision_error(ref32, model, seqs, [len(p) for p in prompts[:n]])
    del ref32
    summ = DV.summarise(divs, compared=n, error=error)
    side = {"a": "greedy's", "b": "speculative's", "neither": "neither"}
    rows = []
    for d, rec in zip(divs, summ["divergences"], strict=True):
        row = {"prompt": d.prompt, "first differing token": d.position, "greedy's token": d.token_a,
               "speculative's token": d.token_b, "float32 logit margin": round(d.margin, 4),
               "bf16 steps": round(d.margin / d.bf16_resolution, 2), "float32 argmax is": side[d.argmax_side]}
        if error is not None:
            row[f"{error.dtype} moves a margin this far at"] = f"{rec['share_moved_this_far']:.2%} of positions"
        rows.append(row)
    return ReplayCheck({"acceptance.divergence": summ}, divergence_text(summ), rows,
                       "each mismatching prompt where it parts from greedy, and the float32 target's margin there")


def _prompts(n: int) -> str:
    return f"{n} prompt" if n == 1 else f"{n} prompts"


def _sides_text(greedy_side: int, spec_side: int, neither: int) -> str:
    """Which run leaves the float32 target's own choice where the outputs part."""
    counts = (f" Where they part, the float32 target's own choice is greedy's token at {_prompts(greedy_side)}, the "
              f"speculative output's at {_prompts(spec_side)}, and neither at {_prompts(neither)}: ")
    if neither or (greedy_side and spec_side):
        return counts + ("both runs leave float32's choice, as rounding does. At temperature 0 every emitted token is "
                         "the target's argmax at verification, so a bad draft cannot change an output; a broken "
                         "target forward would part early and on most prompts.")
    if greedy_side:
        return counts + "only the speculative run leaves float32's choice: look at its verification step."
    return counts + "only the plain greedy run leaves float32's choice."


def divergence_text(summ: dict[str, Any]) -> str:
    """What ``divergence.summarise``'s figures say: ties or not, by the measured yardstick where there is one,
    and which run the float32 target sides with."""
    n = summ["differing_at_a_token"]
    if n == 0:
        return "The outputs that differ do so only in length (one run stopped earlier): there is no token to compare."
    side = _sides_text(summ["argmax_is_a"], summ["argmax_is_b"], summ.get("argmax_is_neither", 0))
    err = summ.get("precision_error")
    if err is None:
        tied = summ["near_ties"]
        return (f"{tied} of {_prompts(n)} that part at a token part where the float32 target's two candidates lie "
                f"within {summ['ties_within_bf16_steps']:g} bf16 steps of each other (largest margin "
                f"{summ['largest_margin']:.4f}): "
                + ("near-ties that bf16 cannot resolve, not a drafter or patch fault." if tied == n else
                   "the others part where the target is not tied: look at those prompts.") + side)
    within = summ["within_measured_error"]
    return (f"Measured yardstick: over {err['positions']:,} positions of the greedy continuations, a {err['dtype']} "
            f"forward of this target picks another token than float32 at {err['argmax_flip_rate']:.2%} of them and "
            f"moves float32's top-2 margin by {summ['yardstick']:.3f} or more at {summ['yardstick_share']:.2%} of them (median "
            f"{err['margin_error_p50']:.4f}, largest {err['margin_error_max']:.3f}). "
            f"{within} of {_prompts(n)} part where the float32 margin is within that"
            + (": ties this precision cannot resolve, not a drafter or patch fault." if within == n else
               "; the others part at margins this target's rounding reaches more rarely (see each prompt's share "
               "in the table): look at those prompts.")
            + f" ({summ['near_ties']} of {n} lie within {summ['ties_within_bf16_steps']:g} bf16 steps.)" + side)


# ---------------------------------------------------------------------------------------------------------
# per draft position


@dataclass
class PositionSummary:
    """Pooled acceptance at k over prompts, with 95% intervals, and the summed counters."""

    k: int
    intervals: PromptIntervals
    total: SpecDecodeStats

    @property
    def tau(self) -> float:
        """τ, the mean acceptance length."""
        return self.intervals.tau.value

    def caption(self) -> str:
        """Caption of the per-position table."""
        return f"{self.intervals.num_prompts} held-out prompts, k = {self.k}, temperature 0; [95% interval]"

    def metrics(self) -> dict[str, Any]:
        """τ, its interval, both rates per position and the counters."""
        iv, total = self.intervals, self.total
        return {"acceptance.k": self.k, "acceptance.mean_acceptance_length": self.tau,
                "acceptance.tau_ci95": [iv.tau.lo, iv.tau.hi],
                "acceptance.conditional_rate": [c.value for c in iv.conditional],
                "acceptance.cumulative_rate": [c.value for c in iv.cumulative],
                "acceptance.per_position_rate": [c.value for c in iv.cumulative],
                "acceptance.draft_acceptance_rate": total.draft_acceptance_rate,
                "acceptance.num_drafts": total.num_drafts, "acceptance.stats": total.to_dict()}

    def note(self) -> str:
        """τ against its ceiling, and how acceptance moves with the position."""
        iv = self.intervals
        return (f"τ = **{self.tau:.2f}** [{iv.tau.lo:.2f}, {iv.tau.hi:.2f}] of a possible {self.k + 1}. "
                + A.position_trend(iv))

    def figures(self) -> list[go.Figure]:
        """Rates per position, τ per prompt, tokens per round."""
        return [A.rates_figure(self.intervals), A.tau_distribution_figure({"held-out": self.intervals.per_prompt_tau}, self.k),
                A.acceptance_length_figure(self.total)]

    def conclusion(self, humaneval_tau: float | None, degenerate: bool) -> str:
        """05's conclusion on the index page."""
        iv = self.intervals
        cond = [c.value for c in iv.conditional]
        return (f"τ = {self.tau:.2f} [{iv.tau.lo:.2f}, {iv.tau.hi:.2f}] of a possible {self.k + 1} at k = {self.k} on "
                f"{iv.num_prompts} held-out prompts; conditional acceptance {', '.join(f'{c:.2f}' for c in cond)}"
                + (f"; HumanEval τ = {humaneval_tau:.2f}" if humaneval_tau is not None else "")
                + ("; inflated by repetition" if degenerate else ""))


def per_position(per_prompt: Sequence[SpecDecodeStats], k: int, seed: int) -> PositionSummary:
    """Per-position summary of per-prompt counters (bootstrap seeded with ``seed``)."""
    return PositionSummary(k, A.prompt_intervals(per_prompt, seed=seed), sum(per_prompt))


# ---------------------------------------------------------------------------------------------------------
# τ against k, modelled speedup


@dataclass
class TauByK:
    """τ at each k on the same prompts, and the speedup modelled from the drafter/target cost ratio."""

    k: int
    tau: float  # at k, from the per-position summary
    curves: dict[str, dict[int, PromptIntervals]]
    draft_seconds: float
    target_seconds: float
    cost_ratio: float
    measured_speedup: float | None = None
    measured_speedup_batch1: float | None = None

    def rows(self) -> list[dict[str, Any]]:
        """One row per k: τ with its interval and the modelled speedup."""
        return [{"k": kk, "τ": interval_text(c.tau), "modelled speedup": round(A.modelled_speedup(c.tau.value, kk, self.cost_ratio), 2)}
                for kk, c in self.curves["held-out"].items()]

    def caption(self) -> str:
        """The measured step costs behind the model."""
        return (f"drafter step {self.draft_seconds * 1e3:.2f} ms, target decode step {self.target_seconds * 1e3:.2f} ms: "
                f"c = {self.cost_ratio:.3f} (measured on this machine); speedup MODELLED")

    def figure(self) -> go.Figure:
        """τ against k with the ceiling k + 1."""
        return A.tau_by_k_figure(self.curves)

    def metrics(self) -> dict[str, Any]:
        """τ per k, the cost ratio, the modelled speedup at k and per k."""
        return {"acceptance.tau_by_k": {str(kk): c.tau.value for kk, c in self.curves["held-out"].items()},
                "acceptance.cost_ratio": self.cost_ratio,
                "acceptance.modelled_speedup": A.modelled_speedup(self.tau, self.k, self.cost_ratio),
                "acceptance.modelled_speedup_by_k": {str(r["k"]): r["modelled speedup"] for r in self.rows()}}

    def note(self) -> str:
        """The modelled speedup at k, the model's best k, and the engine's measured speedup if any."""
        best = max(self.rows(), key=lambda r: r["modelled speedup"])
        return (f"Modelled speedup at k = {self.k}: **{A.modelled_speedup(self.tau, self.k, self.cost_ratio):.2f}×** "
                f"(not measured); the model's best k here is {best['k']} ({best['modelled speedup']}×). "
                + (f"Measured by the engine, warm: **{self.measured_speedup:.2f}×** with the prompts decoded at once"
                   + (f", **{self.measured_speedup_batch1:.2f}×** one prompt at a time"
                      if self.measured_speedup_batch1 is not None else "")
                   + ". The model counts forwards only; a real engine adds the proposer's scheduling and, at large "
                   "batches, verification that no longer rides free on memory bandwidth."
                   if self.measured_speedup is not None else
                   "No measured speedup: the reference decoder's wall time is not a measurement of speed (it "
                   "recomputes every sequence), and no real engine reported wall times."))


def tau_by_k(traces_by_k: Mapping[int, Sequence[Any]], k: int, tau: float, cost: tuple[float, float, float],
             measured_speedup: float | None, seed: int, measured_speedup_batch1: float | None = None) -> TauByK:
    """τ per k from the replay's traces; ``cost``: (drafter step s, target step s, ratio), as
    :func:`eagle3lab.speculate.forward_cost_ratio` measures them."""
    curves = {"held-out": {kk: A.prompt_intervals([t.stats for t in traces], seed=seed) for kk, traces in traces_by_k.items()}}
    return TauByK(k, tau, curves, cost[0], cost[1], cost[2], measured_speedup, measured_speedup_batch1)


# ---------------------------------------------------------------------------------------------------------
# the cost model, measured in the engine


def drafter_device_dtype(timings: Sequence[Any], device: str, dtype: str,
                         target_path: Path | None = None) -> tuple[str, str, str]:
    """(device, dtype, where they come from) for timing the drafter as the engine runs it: what the engine's worker
    reported, else the profile's ``engine.device`` (auto: CUDA when present) and ``target.dtype`` (auto: the target
    config's ``torch_dtype``, else float32)."""
    import json

    import torch

    for t in timings:
        if t.device and t.dtype:
            return t.device, t.dtype, "as the engine's worker reports its target"
    dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dt = dtype
    if dt == "auto":
        cfg = target_path / "config.json" if target_path is not None else None
        raw = json.loads(cfg.read_text()) if cfg is not None and cfg.is_file() else {}
        dt = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return dev, str(dt), "from the profile (the engine reports none)"


def cost_model(decode: EngineDecode, k: int, drafter_path: Path, prompts: Sequence[Sequence[int]], *,
               engine_kind: str, drafter: Any = None, device: str = "auto", dtype: str = "auto",
               target_path: Path | None = None, repeats: int = 10) -> CM.CostModel:
    """The cost-model section from the engine's timed batches (:func:`decode_with_engine`), with our drafter's
    k chained forwards timed in this process at each batch on the engine's device and dtype (``drafter``: the
    module already loaded, else read from ``drafter_path``). Not measured on an engine that timed no batch (the
    reference engine)."""
    import torch

    if not decode.cost_plain or not decode.cost_eagle3:
        return CM.not_measured(k, engine_kind)
    t0 = time.perf_counter()
    timings = [*decode.cost_plain, *decode.cost_eagle3]
    dev, dt, source = drafter_device_dtype(timings, device, dtype, target_path)
    timed = CM.drafter_for_timing(drafter if drafter is not None else load_drafter(drafter_path, "cpu"), dev, dt)
    rows, used = [], []
    for plain, eagle3 in zip(decode.cost_plain, decode.cost_eagle3, strict=True):
        # The drafter attends the context a round sees on average: the prompt and half the new tokens.
        batch = CM.batch_prompts(prompts, plain.batch)
        context = round(statistics.mean(map(len, batch))) + plain.new_tokens // 2
        seconds, n_threads = CM.drafter_round_seconds(timed, plain.batch, k, context, repeats=repeats)
        rows.append(CM.CostRow(plain, eagle3, seconds))
        used.append(n_threads)
    n_params = sum(p.numel() for p in timed.parameters())
    del timed
    n_cpu = torch.get_num_threads()
    threads = ("" if dev != "cpu" else " with 1 CPU thread" if n_cpu == 1 else
               f" (the faster of {n_cpu} CPU threads and 1 at each batch: "
               + ", ".join(f"batch {r.batch}: {n}" for r, n in zip(rows, used, strict=True)) + ")")
    drafter_note = (f"**Drafter:** our drafter module ({n_params / 1e6:.1f}M parameters, embeddings included), timed in "
                    f"this process on {dev}{threads} in {dt} ({source}): k = {k} chained forwards at each batch, the "
                    "first over the verify step's k + 1 positions per request, the rest one token each, over a cached "
                    f"context of the prompt and half the new tokens; median of {repeats} after a warm-up. It is the "
                    "drafter's math in eager PyTorch, not vLLM's proposer: that one's bookkeeping (input "
                    "preparation, attention metadata) falls in the remainder, and its kernels differ (CUDA graphs, "
                    "fused ops): where they run faster than this timing, the remainder is understated by the "
                    "difference.")
    measured = all(t.forward_seconds is not None for t in timings)
    notes = sorted({t.forward_note for t in timings if t.forward_seconds is None})
    verify_note = ("**Verify pass:** the target's forward timed inside the engine's worker (synchronised) in one more "
                   "run of each batch, after the timed ones: over k + 1 tokens per request in the EAGLE-3 engine "
                   "against one token in the plain engine; the extra is the difference of their medians."
                   if measured else
                   "**Verify pass:** " + "; ".join(notes) + ". So the remainder also holds the verify pass's extra "
                   "cost over a one-token step.")
    return CM.CostModel(k, rows, drafter_note=drafter_note, verify_note=verify_note,
                        seconds={"cost model: drafter timing": time.perf_counter() - t0})


# ---------------------------------------------------------------------------------------------------------
# temperature


@dataclass
class TemperatureSummary:
    """τ and conditional rates at T = 0 and at each sampled temperature, on the same prompts."""

    prompts: int
    greedy: PromptIntervals
    sampled: dict[float, PromptIntervals]

    def rows(self) -> list[dict[str, Any]]:
        """One row per temperature."""
        def row(label: str, iv: PromptIntervals) -> dict[str, Any]:
            return {"temperature": label, "prompts": self.prompts, "τ": interval_text(iv.tau),
                    "conditional rates": ", ".join(f"{c.value:.2f}" for c in iv.conditional)}
        return [row("0 (greedy)", self.greedy)] + [row(f"{T:g}", iv) for T, iv in self.sampled.items()]

    def metrics(self) -> dict[str, Any]:
        """τ at T=1 (when sampled) and τ per temperature."""
        out: dict[str, Any] = {}
        if 1.0 in self.sampled:
            out["acceptance.tau_t1"] = self.sampled[1.0].tau.value
        out["acceptance.tau_by_temperature"] = {"0": self.greedy.tau.value,
                                                **{f"{T:g}": v.tau.value for T, v in self.sampled.items()}}
        return out


def temperature_summary(greedy_per_prompt: Sequence[SpecDecodeStats], sampled: SampledDecode,
                        seed: int) -> TemperatureSummary:
    """Intervals at T=0 (``greedy_per_prompt``: the sampled prompts' T=0 counters) and per sampled temperature."""
    return TemperatureSummary(
        sampled.prompts, A.prompt_intervals(greedy_per_prompt, seed=seed),
        {T: A.prompt_intervals(res.per_prompt or [res.stats], seed=seed) for T, res in sampled.by_temperature.items()})


# ---------------------------------------------------------------------------------------------------------
# token view


def token_view_records(records: Sequence[Mapping[str, Any]], k: int) -> list[Mapping[str, Any]]:
    """The records to show token by token: the T=0 prompt at k whose τ is closest to the median (decoded
    records preferred), then the same prompt's sampled records at k."""
    config = f"heldout/main/k{k}/T0"
    t0_recs = ([r for r in records if r["config"] == config and r["source"] == "decoded"]
               or [r for r in records if r["config"] == config])
    med = statistics.median(A.stats_from_record(r).mean_acceptance_length for r in t0_recs)
    chosen = min(t0_recs, key=lambda r: abs(A.stats_from_record(r).mean_acceptance_length - med))
    return [chosen] + [r for r in records
                       if r["prompt_index"] == chosen["prompt_index"] and r["temperature"] > 0 and r["k"] == k]


# ---------------------------------------------------------------------------------------------------------
# repetition


def generated(continuations: Sequence[Any], num_tokens: int) -> list[list[int]]:
    """The first ``num_tokens`` generated tokens of each continuation (the prompt left out)."""
    return [c.sequence[c.prompt_len:c.prompt_len + num_tokens] for c in continuations]


def repetition_row(name: str, st: RepetitionStats) -> dict[str, Any]:
    """One row of the repetition table."""
    return {"text": name, "sequences": st.sequences, "tokens": st.tokens, "distinct tokens": st.distinct_tokens,
            "distinct 4-grams": round(st.distinct_4gram, 3),
            "distinct 4-grams within a sequence": round(st.distinct_4gram_within, 3),
            "tokens in loops": round(st.loop_fraction, 3),
            "longest loop (median, max)": f"{st.longest_loop_median:g}, {st.longest_loop_max}"}


@dataclass
class Repetition:
    """Diversity of the training and evaluated text, the prompt-lookup baseline and EAGLE-3 in and out of loops.

    Without an in-process target only the training text is measured (``ngram`` and the rest stay None).
    """

    k: int
    stats: dict[str, RepetitionStats]
    drafter: PositionSummary
    ngram: PromptIntervals | None = None
    in_loop: SpecDecodeStats | None = None
    outside: SpecDecodeStats | None = None

    @property
    def reasons(self) -> list[str]:
        """Why τ says more about repetition than about the drafter (empty: it does not, or cannot be told)."""
        if self.ngram is None:
            return []
        return R.degeneracy_reasons(self.drafter.tau, self.ngram.tau.value, self.stats[EVAL_TEXT].loop_fraction)

    @property
    def degenerate(self) -> bool:
        """Whether τ is inflated by repetition."""
        return bool(self.reasons)

    def rows(self) -> list[dict[str, Any]]:
        """The repetition table: one row per text."""
        return [repetition_row(name, st) for name, st in self.stats.items()]

    def baseline_rows(self) -> list[dict[str, Any]] | None:
        """EAGLE-3 against prompt lookup, and EAGLE-3's rounds in and out of loops (None without a replay)."""
        if self.ngram is None or self.in_loop is None or self.outside is None:
            return None
        return [{"drafter": "EAGLE-3 (04)", "τ": interval_text(self.drafter.intervals.tau)},
                {"drafter": "prompt lookup (no model)", "τ": interval_text(self.ngram.tau)},
                {"drafter": "EAGLE-3, rounds starting inside a loop",
                 "τ": f"{self.in_loop.mean_acceptance_length:.3f} ({self.in_loop.num_drafts} rounds)"},
                {"drafter": "EAGLE-3, rounds starting outside loops",
                 "τ": f"{self.outside.mean_acceptance_length:.3f} ({self.outside.num_drafts} rounds)"}]

    def baseline_caption(self) -> str:
        """Caption of the baseline table."""
        return f"held-out prompts, k = {self.k}, temperature 0"

    def metrics(self) -> dict[str, Any]:
        """Diversity of the training (and evaluated) text, the baseline's τ, and the degeneracy verdict."""
        train = self.stats[TRAIN_TEXT]
        out: dict[str, Any] = {"acceptance.train_distinct_4gram": train.distinct_4gram,
                               "acceptance.train_loop_fraction": train.loop_fraction}
        if self.ngram is not None and self.in_loop is not None and self.outside is not None:
            ev = self.stats[EVAL_TEXT]
            out.update({
                "acceptance.eval_distinct_4gram": ev.distinct_4gram, "acceptance.eval_loop_fraction": ev.loop_fraction,
                "acceptance.eval_longest_loop": ev.longest_loop_median, "acceptance.ngram_tau": self.ngram.tau.value,
                "acceptance.tau_in_loops": self.in_loop.mean_acceptance_length if self.in_loop.num_drafts else None,
                "acceptance.tau_outside_loops": self.outside.mean_acceptance_length if self.outside.num_drafts else None,
            })
        out["acceptance.degenerate"] = self.degenerate
        out["acceptance.degenerate_reason"] = "; ".join(self.reasons)
        return out

    def caveat(self) -> str | None:
        """The caveat for the index page when τ is inflated by repetition, else None."""
        if not self.degenerate:
            return None
        out = self.outside
        return "τ is inflated by repetition: " + "; ".join(self.reasons) + ". " + (
            f"The {out.num_drafts} rounds that start outside loops reach τ = {out.mean_acceptance_length:.2f}: "
            "closer to what this drafter predicts." if out is not None and out.num_drafts else
            "No round starts outside a loop, so this text cannot show what the drafter predicts beyond copying.")

    def note(self) -> str | None:
        """The sentence under the tables (None without a replay and without a caveat)."""
        caveat = self.caveat()
        if caveat is not None:
            return "**" + caveat + "**"
        if self.ngram is None:
            return None
        return (f"Repetition does not dominate: prompt lookup reaches τ = {self.ngram.tau.value:.2f}, "
                f"{self.stats[EVAL_TEXT].loop_fraction:.0%} of evaluated tokens lie in loops.")


def repetition(train_outputs: Sequence[Sequence[int]], drafter: PositionSummary, replay: Replay | None, k: int,
               max_new_tokens: int, eos_token_id: int | None, seed: int) -> Repetition:
    """Repetition of 03's responses and, with a replay, of the evaluated continuations, with the prompt-lookup
    drafter replayed on them and EAGLE-3's rounds split by whether they start inside a loop."""
    res = Repetition(k, {TRAIN_TEXT: R.repetition_stats(train_outputs)}, drafter)
    if replay is None:
        return res
    conts = replay.continuations
    res.stats[EVAL_TEXT] = R.repetition_stats(generated(conts, max_new_tokens))
    ngram = SP.replay_drafter(None, conts, [k], max_new_tokens, eos_token_id)[k]
    res.ngram = A.prompt_intervals([t.stats for t in ngram], seed=seed)
    res.in_loop, res.outside = R.split_rounds_by_loops([c.sequence for c in conts], [c.prompt_len for c in conts],
                                                       replay.traces[k], k)
    return res


# ---------------------------------------------------------------------------------------------------------
# HumanEval


@dataclass
class HumanEval:
    """HumanEval prompts through the same exact replay: the drafter, prompt lookup, and repetition."""

    k: int
    prompts: list[list[int]]
    traces: list[Any]
    drafter: PromptIntervals
    ngram: PromptIntervals
    repetition: RepetitionStats
    seconds: dict[str, float] = field(default_factory=dict)

    def rows(self, heldout: Repetition, heldout_prompts: int) -> list[dict[str, Any]]:
        """HumanEval beside the held-out split (``heldout``: its repetition section, on ``heldout_prompts``
        prompts) and published anchors."""
        col = f"τ at k={self.k}"
        if heldout.ngram is None:
            raise ValueError("the held-out split has no prompt-lookup replay to compare with")
        ev = heldout.stats[EVAL_TEXT]
        return [{"prompts": f"held-out split ({heldout_prompts})", col: interval_text(heldout.drafter.intervals.tau, 2),
                 "prompt lookup τ": f"{heldout.ngram.tau.value:.2f}", "tokens in loops": f"{ev.loop_fraction:.0%}"},
                {"prompts": f"HumanEval ({len(self.prompts)})", col: interval_text(self.drafter.tau, 2),
                 "prompt lookup τ": f"{self.ngram.tau.value:.2f}", "tokens in loops": f"{self.repetition.loop_fraction:.0%}"},
                *({"prompts": name, col: value, "prompt lookup τ": "–", "tokens in loops": "–"}
                  for name, value in PUBLISHED_TAU)]

    def figure(self, heldout: PositionSummary) -> go.Figure:
        """τ per prompt, held-out and HumanEval."""
        return A.tau_distribution_figure({"held-out": heldout.intervals.per_prompt_tau,
                                          "HumanEval": self.drafter.per_prompt_tau}, self.k)

    def metrics(self) -> dict[str, Any]:
        """τ with its interval, the prompt count, prompt lookup's τ and the loop share."""
        return {"acceptance.humaneval_tau": self.drafter.tau.value,
                "acceptance.humaneval_tau_ci95": [self.drafter.tau.lo, self.drafter.tau.hi],
                "acceptance.humaneval_prompts": len(self.prompts),
                "acceptance.humaneval_ngram_tau": self.ngram.tau.value,
                "acceptance.humaneval_loop_fraction": self.repetition.loop_fraction}


def humaneval(ref: Any, drafter: Any, tokenizer: Any, num_prompts: int, prompt_tokens: int, new_tokens: int, k: int,
              layer_ids: Sequence[int], seed: int) -> HumanEval:
    """Continue HumanEval prompts greedily and replay the drafter and prompt lookup on them at k."""
    t0 = time.perf_counter()
    prompts = humaneval_prompts(tokenizer, num_prompts, prompt_tokens)
    conts = SP.greedy_continuations(ref, prompts, new_tokens + k, layer_ids, batch_size=64)
    traces = SP.replay_drafter(drafter, conts, [k], new_tokens, ref.eos_token_id)[k]
    ngram = SP.replay_drafter(None, conts, [k], new_tokens, ref.eos_token_id)[k]
    seconds = {"HumanEval": time.perf_counter() - t0}
    return HumanEval(k, prompts, traces, A.prompt_intervals([t.stats for t in traces], seed=seed),
                     A.prompt_intervals([t.stats for t in ngram], seed=seed),
                     R.repetition_stats(generated(conts, new_tokens)), seconds)


@dataclass
class EngineHumanEval:
    """HumanEval through the profile's engine's own speculative decoding: vLLM's spec-decode counters, the figure
    a deployment reads, beside the exact replay's (which runs the drafter on transformers' greedy continuation)."""

    k: int
    prompts: int
    new_tokens: int
    stats: Any
    seconds: float

    def row(self, replay_tau: float | None) -> dict[str, Any]:
        return {"HumanEval prompts": self.prompts, "new tokens each": self.new_tokens,
                f"τ at k={self.k}, vLLM's counters": f"{self.stats.mean_acceptance_length:.3f}",
                "drafts": self.stats.num_drafts,
                "per position": ", ".join(f"{r:.3f}" for r in self.stats.per_position_rate),
                "τ, exact replay": "–" if replay_tau is None else f"{replay_tau:.3f}"}

    def metrics(self) -> dict[str, Any]:
        return {"acceptance.humaneval_engine_tau": self.stats.mean_acceptance_length,
                "acceptance.humaneval_engine_drafts": self.stats.num_drafts,
                "acceptance.humaneval_engine_per_position_rate": self.stats.per_position_rate}


def humaneval_with_engine(engine: Any, engine_kind: str, prompts: Sequence[Sequence[int]], drafter_path: Path,
                          k: int, new_tokens: int) -> EngineHumanEval | None:
    """The HumanEval prompts decoded by ``engine`` with the drafter, greedy, τ from the engine's counters; ``None``
    on the reference engine, whose decoder is the replay itself."""
    if engine_kind != "vllm":
        return None
    t0 = time.perf_counter()
    res = engine.speculative_generate([list(p) for p in prompts], drafter_path, k, new_tokens)
    if not res.stats.num_drafts:
        raise RuntimeError("vLLM's spec-decode counters did not move over the HumanEval decode: no drafts counted")
    return EngineHumanEval(k, len(prompts), new_tokens, res.stats, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------
# per target layer: all-layer states, probe, ablation


def extract_all_layers(ref: Any, samples: Sequence[Mapping[str, Any]], layer_samples: int | None, folder: Path,
                       target_path: Path, extraction_kw: Mapping[str, Any]) -> tuple[Any, dict[str, float]]:
    """Every layer's aux states of the first ``layer_samples`` training samples (None: all), in ``folder``;
    returns (dataset, seconds)."""
    t0 = time.perf_counter()
    samples_file = folder / "samples.jsonl"
    write_jsonl_atomic(samples_file, list(samples[: layer_samples or len(samples)]))
    all_layers = SW.extract_all_layers(ref, samples_file, target_path, folder, **extraction_kw)
    return all_layers, {"all-layer extraction": time.perf_counter() - t0}


def probe(ref: Any, all_layers: Any, continuations: Sequence[Any], layer_ids: Sequence[int], num_layers: int,
          probe_tokens: int, top_k: int, steps: int, seed: int) -> tuple[Any, dict[str, float]]:
    """Logit lens and tuned lens per layer id: trained on states sampled from ``all_layers``, scored on the
    continuations' generated positions. Returns (:class:`eagle3lab.probe.ProbeResult`, seconds)."""
    import torch

    t0 = time.perf_counter()
    readout = PR.readout_from_model(ref.model)
    h = all_layers.hidden_size
    train_aux = PR.sample_states(all_layers, probe_tokens, seed)
    tr_states, tr_labels = PR.states_and_labels(train_aux, layer_ids, h, readout, num_layers)
    ev_states, ev_labels = PR.states_and_labels(torch.cat([c.aux[c.prompt_len:] for c in continuations]), layer_ids,
                                                h, readout, num_layers)
    res = PR.probe_layers(layer_ids, tr_states, tr_labels, ev_states, ev_labels, readout, top_k=top_k, steps=steps,
                          batch_size=128, lr=3e-3, seed=seed)
    return res, {"layer probe": time.perf_counter() - t0}


def probe_rows(layer_ids: Sequence[int], res: Any) -> list[dict[str, Any]]:
    """One row per layer id: logit-lens and tuned-lens agreement."""
    return [{"aux id": i, "logit lens top-1": round(a, 3), "tuned lens top-1": round(b, 3),
             f"tuned lens top-{res.top_k}": round(c, 3)}
            for i, a, b, c in zip(layer_ids, res.lens_top1, res.tuned_top1, res.tuned_topk, strict=True)]


def _before_final(layer_ids: Sequence[int], tuned_top1: Sequence[float], num_layers: int) -> list[tuple[float, int]]:
    # The final state (id == num_layers) is what the target's head reads: the best layer is sought below it.
    return [(v, i) for i, v in zip(layer_ids, tuned_top1, strict=True) if i < num_layers]


def probe_metrics(layer_ids: Sequence[int], res: Any, num_layers: int) -> dict[str, Any]:
    """Tuned top-1 / top-k and logit-lens top-1 per id, and the best id below the final state."""
    below = _before_final(layer_ids, res.tuned_top1, num_layers)
    return {"acceptance.probe_top1": {str(i): v for i, v in zip(layer_ids, res.tuned_top1, strict=True)},
            "acceptance.probe_topk": {str(i): v for i, v in zip(layer_ids, res.tuned_topk, strict=True)},
            "acceptance.probe_lens_top1": {str(i): v for i, v in zip(layer_ids, res.lens_top1, strict=True)},
            "acceptance.probe_best_layer": max(below)[1] if below else num_layers}


def probe_line(layer_ids: Sequence[int], res: Any, num_layers: int, aux_layer_ids: Sequence[int]) -> str:
    """The probe's sentence in the closing section."""
    v, i = max(_before_final(layer_ids, res.tuned_top1, num_layers))
    by_id = ", ".join(f"id {j}: {t:.0%}" for j, t in zip(layer_ids, res.tuned_top1, strict=True))
    return (f"**Probe:** tuned-lens agreement with the target's next token by layer: {by_id} (logit lens: "
            + ", ".join(f"{t:.0%}" for t in res.lens_top1) + f"). The best state before the final one "
            f"is id {i} ({v:.0%}); the drafter reads ids {list(aux_layer_ids)}.")


@dataclass
class Ablation:
    """Drafters trained on other aux-layer sets with one budget, compared by τ on the same prompts."""

    results: dict[str, tuple[list[int], PromptIntervals]]  # set name -> (ids, τ intervals)
    rows_trained: list[dict[str, Any]]
    skipped: list[dict[str, str]]  # set, why skipped
    traces: list[tuple[list[int], list[Any]]] = field(default_factory=list)  # (ids, traces) per trained set
    seconds: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """Trained sets, then skipped ones with the reason."""
        return self.rows_trained + [{"set": x["set"], "aux ids": "–", "τ": "skipped: " + x["why skipped"]}
                                    for x in self.skipped]

    def figure(self, num_layers: int) -> go.Figure:
        """Which ids each set reads, and its τ."""
        return SW.ablation_figure(self.results, num_layers, reference="profile")

    def _best_name(self) -> str:
        return max(self.results, key=lambda n: self.results[n][1].tau.value)

    def best(self) -> str:
        """The set with the highest τ, as ``name [ids]``."""
        name = self._best_name()
        return f"{name} {self.results[name][0]}"

    def tied_with_best(self) -> list[str]:
        """The other sets whose 95% interval reaches the best set's: within the noise of the winner. The same
        code and seed pick another winner on another CPU (issue 35), so a winner is named only when this is
        empty."""
        name = self._best_name()
        lo = self.results[name][1].tau.lo
        return [f"{n} {ids}" for n, (ids, iv) in self.results.items() if n != name and iv.tau.hi >= lo]

    def metrics(self) -> dict[str, Any]:
        """τ and its interval per set; the best set, and whether it is resolved (its interval above every other's)."""
        tied = self.tied_with_best()
        return {"acceptance.ablation": {f"{n} {ids}": v.tau.value for n, (ids, v) in self.results.items()},
                "acceptance.ablation_ci95": {f"{n} {ids}": [v.tau.lo, v.tau.hi] for n, (ids, v) in self.results.items()},
                "acceptance.ablation_best": self.best(),
                "acceptance.ablation_resolved": not tied,
                "acceptance.ablation_tied_with_best": tied}

    def line(self, ablation_steps: int, drafter_steps: Any) -> str:
        """The ablation's sentence in the closing section (``drafter_steps``: 04's training steps, or '?')."""
        ranked = sorted(self.results.items(), key=lambda kv: -kv[1][1].tau.value)
        (bn, (bids, biv)), (wn, (wids, wiv)) = ranked[0], ranked[-1]
        overlap = biv.tau.lo <= wiv.tau.hi
        tied = self.tied_with_best()
        verdict = ("; their 95% intervals overlap, so with this budget the layer choice is not resolved." if overlap
                   else "; the intervals do not overlap.")
        if tied and not overlap:
            verdict += (f" The best set's interval still overlaps {len(tied)} other set(s) ({', '.join(tied)}): no "
                        "winner is named among those.")
        elif not tied:
            verdict += " The best set's interval lies above every other set's."
        return (f"**Ablation:** best set {bn} {bids} (τ = {biv.tau.value:.2f} [{biv.tau.lo:.2f}, {biv.tau.hi:.2f}]), "
                f"worst {wn} {wids} (τ = {wiv.tau.value:.2f} [{wiv.tau.lo:.2f}, {wiv.tau.hi:.2f}])"
                + verdict + f" All were trained {ablation_steps} steps (04's "
                f"drafter: {drafter_steps}), so compare them with each other.")


def ablation_from_results(trained: Sequence[tuple[Any, list[Any]]], sets: Sequence[Any], seed: int) -> Ablation:
    """An :class:`Ablation` from :func:`eagle3lab.sweep.run_ablation`'s ``(result, traces)`` pairs and the sets."""
    out = Ablation({}, [], [{"set": s.name, "why skipped": s.why} for s in sets if s.ids is None])
    for res, traces in trained:
        out.seconds[f"ablation {res.ids}"] = res.train_seconds
        ivs = A.prompt_intervals(res.per_prompt, seed=seed)
        out.results[res.name] = (res.ids, ivs)
        out.rows_trained.append({"set": res.name, "aux ids": res.ids, "τ": interval_text(ivs.tau),
                                 "train accuracy (pos 1)": round(res.train_accuracy[0], 3),
                                 "seconds": round(res.train_seconds, 1)})
        out.traces.append((res.ids, traces))
    return out


# ---------------------------------------------------------------------------------------------------------
# closing


def repetition_line(rep: Repetition, humaneval_tau: float | None) -> str:
    """The repetition sentence in the closing section (needs the replay)."""
    if rep.ngram is None:
        raise ValueError("no prompt-lookup replay: the repetition sentence needs the held-out replay")
    return (f"**Repetition:** prompt lookup alone reaches τ = {rep.ngram.tau.value:.2f} against the drafter's "
            f"{rep.drafter.tau:.2f}; {rep.stats[EVAL_TEXT].loop_fraction:.0%} of evaluated tokens lie in loops"
            + (f"; HumanEval gives τ = {humaneval_tau:.2f}." if humaneval_tau is not None else "."))


def closing_note(lines: Sequence[str | None]) -> str:
    """The closing section's paragraphs (None: a view that did not run)."""
    return "\n\n".join(x for x in lines if x) or "No per-layer views ran."


def timing_rows(timings: Mapping[str, float]) -> dict[str, float]:
    """Seconds per step, one decimal."""
    return {name: round(s, 1) for name, s in timings.items()}
