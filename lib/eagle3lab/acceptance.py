"""Acceptance statistics of speculative decoding, in vLLM's terms, and their figures.

The counters are the ones vLLM exports (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``), so numbers from our reference decoder
and from a vLLM engine can sit in one table:

- mean acceptance length = 1 + accepted / drafts (the target's own token counts as one per round);
- cumulative acceptance rate at position i = accepted_per_pos[i] / drafts (vLLM's per-position rate: the
  fraction of rounds whose draft i was accepted; it can only fall with i because a chain stops at its
  first rejection);
- conditional acceptance rate at position i = accepted_per_pos[i] / accepted_per_pos[i-1] (drafts for i=0):
  of the rounds that reached position i (all earlier drafts accepted), the fraction that accepted draft i.
  It can rise or fall with i; it is what says whether later drafts are worse;
- draft acceptance rate = accepted / draft tokens.

Intervals are over prompts (a prompt's rounds are not independent of each other): a percentile bootstrap
that resamples prompts and recomputes the pooled ratio.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

METRIC_PREFIX = "vllm:spec_decode_"
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_PER_POS = "num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeStats:
    """Cumulative counters of chain speculative decoding (the same as vLLM's spec-decode metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # How many rounds accepted exactly n drafts (index n); not a vLLM metric, used for the distribution figure.
    accepted_hist: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per target forward: 1 + accepted / drafts (nan without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_rate(self) -> list[float]:
        """accepted_per_pos[i] / num_drafts for each draft position i."""
        if not self.num_drafts:
            return [float("nan")] * len(self.accepted_per_pos)
        return [a / self.num_drafts for a in self.accepted_per_pos]

    @property
    def conditional_rate(self) -> list[float]:
        """accepted_per_pos[i] / (rounds that reached position i): nan where no round reached it."""
        reached = [self.num_drafts, *self.accepted_per_pos[:-1]]
        return [a / r if r else float("nan") for a, r in zip(self.accepted_per_pos, reached, strict=True)]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    def record_round(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verification round that proposed ``num_proposed`` and accepted the first ``num_accepted``."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposed drafts: impossible")
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.accepted_per_pos = _padded(self.accepted_per_pos, num_proposed)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        self.accepted_hist = _padded(self.accepted_hist, num_proposed + 1)
        self.accepted_hist[num_accepted] += 1

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        if not isinstance(other, SpecDecodeStats):
            return NotImplemented
        return SpecDecodeStats(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_pos=_add_lists(self.accepted_per_pos, other.accepted_per_pos),
            accepted_hist=_add_lists(self.accepted_hist, other.accepted_hist),
        )

    def __radd__(self, other: Any) -> SpecDecodeStats:
        # Lets sum(list_of_stats) work (sum starts from 0).
        if other == 0:
            return self
        return self.__add__(other)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: the counters plus the derived rates."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "accepted_hist": list(self.accepted_hist),
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_rate": self.per_position_rate,
            "conditional_rate": self.conditional_rate,
            "draft_acceptance_rate": self.draft_acceptance_rate,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpecDecodeStats:
        """Inverse of :meth:`to_dict` (derived rates are ignored: they are recomputed)."""
        return cls(
            num_drafts=int(d["num_drafts"]),
            num_draft_tokens=int(d["num_draft_tokens"]),
            num_accepted_tokens=int(d["num_accepted_tokens"]),
            accepted_per_pos=[int(x) for x in d.get("accepted_per_pos", [])],
            accepted_hist=[int(x) for x in d.get("accepted_hist", [])],
        )


def _padded(xs: list[int], n: int) -> list[int]:
    return list(xs) + [0] * (n - len(xs)) if len(xs) < n else list(xs)


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    a, b = _padded(a, n), _padded(b, n)
    return [x + y for x, y in zip(a, b, strict=False)]


def _snapshot_values(snapshot: Iterable[Any]) -> dict[str, Any]:
    """Sum vLLM metric objects by name (several engines/labels add up); vectors are summed per position."""
    out: dict[str, Any] = {}
    for m in snapshot:
        name = getattr(m, "name", "")
        if not name.startswith(METRIC_PREFIX):
            continue
        key = name[len(METRIC_PREFIX) :]
        if key == _PER_POS and hasattr(m, "values"):
            out[key] = _add_lists(out.get(key, []), [int(v) for v in m.values])
        elif key in _COUNTERS and hasattr(m, "value"):
            out[key] = out.get(key, 0) + int(m.value)
    return out


def stats_from_vllm_metrics(before: Iterable[Any] | None, after: Iterable[Any]) -> SpecDecodeStats:
    """Spec-decode counters between two ``llm.get_metrics()`` snapshots (``before`` None: since start).

    vLLM's counters are cumulative over the engine's life, so a measurement is the difference of a
    snapshot taken after the workload and one taken before it.
    """
    b = _snapshot_values(before or [])
    a = _snapshot_values(after)
    if "num_drafts" not in a:
        raise ValueError(
            "no vllm:spec_decode_* metrics in the snapshot: was the LLM built with a speculative_config "
            "and disable_log_stats=False?"
        )
    per_pos_after = a.get(_PER_POS, [])
    per_pos_before = _padded(b.get(_PER_POS, []), len(per_pos_after))
    diff = {k: a.get(k, 0) - b.get(k, 0) for k in _COUNTERS}
    if any(v < 0 for v in diff.values()):
        raise ValueError(f"counters went backwards between snapshots ({diff}): snapshots out of order?")
    return SpecDecodeStats(
        num_drafts=diff["num_drafts"],
        num_draft_tokens=diff["num_draft_tokens"],
        num_accepted_tokens=diff["num_accepted_tokens"],
        accepted_per_pos=[x - y for x, y in zip(per_pos_after, per_pos_before, strict=False)],
    )


def acceptance_table(stats: SpecDecodeStats) -> list[dict[str, Any]]:
    """One row per draft position: accepted count and rate, and the cumulative expected length."""
    rows = []
    cum = 1.0
    for i, (n, r) in enumerate(zip(stats.accepted_per_pos, stats.per_position_rate, strict=False)):
        cum += r
        rows.append({"position": i + 1, "accepted": n, "rate": r, "expected_length_up_to_here": cum})
    return rows


def per_position_figure(stats: SpecDecodeStats, title: str = "Per-position acceptance rate") -> go.Figure:
    """Bar chart of accepted_per_pos[i] / num_drafts, with the mean acceptance length in the title."""
    rates = stats.per_position_rate
    fig = go.Figure(
        go.Bar(
            x=[f"draft {i + 1}" for i in range(len(rates))],
            y=rates,
            text=[f"{r:.2f}" for r in rates],
            textposition="outside",
        )
    )
    fig.update_layout(
        title=f"{title} (mean acceptance length {stats.mean_acceptance_length:.2f}, {stats.num_drafts} drafts)",
        yaxis={"title": "accepted / drafts", "range": [0, 1.05]},
        xaxis={"title": "draft position"},
    )
    return fig


# bf16 engine vs float32 reference: rates computed over a few hundred rounds differ by a few hundredths when
# the same drafter meets slightly different target states (seen on the H200: at most 0.015 over 820 rounds).
ENGINE_REFERENCE_TOL = 0.05


@dataclass
class EngineVsReference:
    """Per-position acceptance of an engine against the reference decoder, same drafter and prompts."""

    rows: list[dict[str, Any]]
    max_gap: float
    tolerance: float

    @property
    def agree(self) -> bool:
        return self.max_gap <= self.tolerance


def engine_vs_reference(
    engine: SpecDecodeStats, reference: SpecDecodeStats, tolerance: float = ENGINE_REFERENCE_TOL
) -> EngineVsReference:
    """Side by side: each position's rate (accepted at that position / rounds) from the engine's counters and
    from the reference decoder, their gap, and tau from each. Raises ValueError when either ran no round."""
    if not engine.num_drafts or not reference.num_drafts:
        raise ValueError(f"no drafting rounds to compare (engine {engine.num_drafts}, reference {reference.num_drafts})")
    e, r = engine.per_position_rate, reference.per_position_rate
    n = max(len(e), len(r))
    e, r = e + [0.0] * (n - len(e)), r + [0.0] * (n - len(r))
    rows = [{"position": i + 1, "engine": round(a, 4), "reference": round(b, 4), "gap": round(a - b, 4)}
            for i, (a, b) in enumerate(zip(e, r, strict=True))]
    rows.append({"position": "τ", "engine": round(engine.mean_acceptance_length, 4),
                 "reference": round(reference.mean_acceptance_length, 4),
                 "gap": round(engine.mean_acceptance_length - reference.mean_acceptance_length, 4)})
    return EngineVsReference(rows, max(abs(a - b) for a, b in zip(e, r, strict=True)), tolerance)


def acceptance_length_figure(stats: SpecDecodeStats) -> go.Figure:
    """Distribution of tokens produced per round (accepted drafts + 1); needs ``accepted_hist``.

    Falls back to the cumulative curve 1 + sum of per-position rates when the histogram is unknown
    (for example for stats converted from vLLM metrics, which only have per-position counts).
    """
    fig = go.Figure()
    if stats.accepted_hist and sum(stats.accepted_hist):
        total = sum(stats.accepted_hist)
        fig.add_bar(
            x=[n + 1 for n in range(len(stats.accepted_hist))],
            y=[c / total for c in stats.accepted_hist],
            name="fraction of rounds",
        )
        fig.update_layout(
            title="Tokens produced per verification round", xaxis_title="tokens (accepted drafts + 1)",
            yaxis_title="fraction of rounds",
        )
    else:
        cum = [1.0]
        for r in stats.per_position_rate:
            cum.append(cum[-1] + r)
        fig.add_scatter(x=list(range(len(cum))), y=cum, mode="lines+markers", name="expected length")
        fig.update_layout(
            title="Expected acceptance length using the first n drafts", xaxis_title="n drafts",
            yaxis_title="expected tokens per round",
        )
    return fig


def layer_sweep_figure(results: Mapping[str, SpecDecodeStats]) -> go.Figure:
    """Grouped bars of per-position acceptance for several aux-layer choices (label -> stats)."""
    if not results:
        raise ValueError("layer_sweep_figure: no results to compare")
    fig = go.Figure()
    for label, st in results.items():
        fig.add_bar(
            x=[f"draft {i + 1}" for i in range(len(st.accepted_per_pos))],
            y=st.per_position_rate,
            name=f"{label}: τ={st.mean_acceptance_length:.2f}",
        )
    fig.update_layout(
        barmode="group", title="Per-position acceptance by aux-layer choice (τ = mean acceptance length)",
        yaxis={"title": "accepted / drafts", "range": [0, 1.05]},
    )
    return fig


# ---------------------------------------------------------------------------------------------------------
# intervals over prompts


@dataclass
class Interval:
    """A point estimate with a 95% interval."""

    value: float
    lo: float
    hi: float


@dataclass
class PromptIntervals:
    """Pooled rates with 95% bootstrap intervals over prompts."""

    tau: Interval
    cumulative: list[Interval]
    conditional: list[Interval]
    num_prompts: int
    per_prompt_tau: list[float]


def _pooled(per_prompt: Sequence[SpecDecodeStats], k: int) -> Any:
    import numpy as np

    drafts = np.array([s.num_drafts for s in per_prompt], dtype=float)
    acc = np.array([_padded(s.accepted_per_pos, k)[:k] for s in per_prompt], dtype=float).reshape(len(per_prompt), k)
    return drafts, acc


def _rates(drafts: Any, acc: Any) -> tuple[Any, Any, Any]:
    import numpy as np

    # drafts [..., P], acc [..., P, k] -> tau [...], cumulative [..., k], conditional [..., k]
    d = drafts.sum(-1)
    a = acc.sum(-2)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = 1 + a.sum(-1) / d
        cum = a / d[..., None]
        reached = np.concatenate([d[..., None], a[..., :-1]], axis=-1)
        cond = a / reached
    return tau, cum, cond


def prompt_intervals(
    per_prompt: Sequence[SpecDecodeStats], num_boot: int = 2000, seed: int = 0
) -> PromptIntervals:
    """tau, cumulative and conditional per-position rates pooled over prompts, with 95% intervals.

    Percentile bootstrap over prompts: prompts are resampled with replacement and the pooled ratios
    recomputed ``num_boot`` times (seeded, so a run is reproducible).
    """
    import numpy as np

    per_prompt = [s for s in per_prompt if s.num_drafts]
    if not per_prompt:
        raise ValueError("prompt_intervals: no prompt has any draft")
    k = max(len(s.accepted_per_pos) for s in per_prompt)
    drafts, acc = _pooled(per_prompt, k)
    tau, cum, cond = _rates(drafts, acc)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_prompt), size=(num_boot, len(per_prompt)))
    btau, bcum, bcond = _rates(drafts[idx], acc[idx])

    def iv(point: float, boots: Any) -> Interval:
        b = boots[~np.isnan(boots)]
        if not len(b):
            return Interval(float(point), float("nan"), float("nan"))
        lo, hi = np.percentile(b, [2.5, 97.5])
        return Interval(float(point), float(lo), float(hi))

    return PromptIntervals(
        tau=iv(tau, btau),
        cumulative=[iv(cum[i], bcum[:, i]) for i in range(k)],
        conditional=[iv(cond[i], bcond[:, i]) for i in range(k)],
        num_prompts=len(per_prompt),
        per_prompt_tau=[s.mean_acceptance_length for s in per_prompt],
    )


def interval_table(iv: PromptIntervals) -> list[dict[str, Any]]:
    """One row per draft position: both rates with their 95% intervals (3 decimals)."""
    return [
        {"position": i + 1,
         "conditional (accepted at i / reached i)": f"{c.value:.3f} [{c.lo:.3f}, {c.hi:.3f}]",
         "cumulative (accepted at i / drafts)": f"{u.value:.3f} [{u.lo:.3f}, {u.hi:.3f}]"}
        for i, (c, u) in enumerate(zip(iv.conditional, iv.cumulative, strict=True))
    ]


def _err(ivs: Sequence[Interval]) -> dict[str, Any]:
    return {"type": "data", "symmetric": False,
            "array": [i.hi - i.value for i in ivs], "arrayminus": [i.value - i.lo for i in ivs]}


def rates_figure(iv: PromptIntervals, title: str = "Acceptance per draft position") -> go.Figure:
    """Conditional and cumulative rates per draft position, 95% intervals over prompts as error bars."""
    x = [f"draft {i + 1}" for i in range(len(iv.cumulative))]
    fig = go.Figure()
    fig.add_bar(x=x, y=[i.value for i in iv.conditional], error_y=_err(iv.conditional),
                name="conditional: accepted at i / rounds that reached i")
    fig.add_bar(x=x, y=[i.value for i in iv.cumulative], error_y=_err(iv.cumulative),
                name="cumulative: accepted at i / drafts (vLLM's per-position rate)")
    fig.update_layout(
        barmode="group", title=f"{title} (τ = {iv.tau.value:.2f} [{iv.tau.lo:.2f}, {iv.tau.hi:.2f}], "
        f"{iv.num_prompts} prompts, 95% intervals over prompts)",
        yaxis={"title": "acceptance rate", "range": [0, 1.08]}, xaxis={"title": "draft position"},
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def tau_distribution_figure(per_prompt_tau: Mapping[str, Sequence[float]], k: int) -> go.Figure:
    """Histogram of per-prompt mean acceptance length, one trace per prompt set."""
    fig = go.Figure()
    for name, taus in per_prompt_tau.items():
        fig.add_histogram(x=list(taus), name=f"{name} ({len(taus)} prompts)", xbins={"start": 1, "end": k + 1.0001,
                          "size": k / 24}, opacity=0.7)
    fig.update_layout(barmode="overlay", title=f"Mean acceptance length per prompt (out of k+1 = {k + 1})",
                      xaxis={"title": "τ of the prompt", "range": [1, k + 1.05]}, yaxis_title="prompts")
    return fig


def tau_by_k_figure(curves: Mapping[str, Mapping[int, PromptIntervals]]) -> go.Figure:
    """τ against k (one line per drafter or prompt set) with 95% intervals, and the ceiling k+1."""
    fig = go.Figure()
    ks: set[int] = set()
    for name, by_k in curves.items():
        xs = sorted(by_k)
        ks.update(xs)
        fig.add_scatter(x=xs, y=[by_k[x].tau.value for x in xs], error_y=_err([by_k[x].tau for x in xs]),
                        mode="lines+markers", name=name)
    xs = sorted(ks)
    fig.add_scatter(x=xs, y=[x + 1 for x in xs], mode="lines", line={"dash": "dot", "color": "grey"},
                    name="ceiling k+1")
    fig.update_layout(title="Mean acceptance length τ against k (same drafter, temperature 0)",
                      xaxis={"title": "k (num_speculative_tokens)", "dtick": 1},
                      yaxis={"title": "τ (tokens per target forward)"})
    return fig


# ---------------------------------------------------------------------------------------------------------
# modelled speedup


def modelled_speedup(tau: float, k: int, cost_ratio: float) -> float:
    """Tokens per unit of time relative to plain decoding: τ / (1 + k * c).

    One round costs one target forward plus k drafter forwards (c = drafter forward / target forward) and
    yields τ tokens. A model, not a measurement: it ignores that verifying k+1 tokens costs more than a
    one-token decode step, scheduling, and sampling overheads.
    """
    if k < 1 or cost_ratio < 0:
        raise ValueError(f"need k >= 1 and cost_ratio >= 0 (got {k}, {cost_ratio})")
    return tau / (1 + k * cost_ratio)


def implied_cost_ratio(tau: float, k: int, baseline_tokens_per_s: float, eagle3_tokens_per_s: float) -> float:
    """The c that makes :func:`modelled_speedup` equal a measured speedup: the engine's cost of one draft step,
    verification and scheduling included, in target decode steps.

    A round of τ tokens takes τ / eagle3_tokens_per_s; a target step 1 / baseline_tokens_per_s; so
    c = (τ · baseline / eagle3 − 1) / k. It can differ from the c timed on transformers forwards by tenfold: on
    2026-12-03 the 16-layer GPU target's engine gave 0.65 at batch 1 against 0.05 in eager transformers, where
    the target's Python-launched layers, not the draft, dominate a step.
    """
    if k < 1 or tau <= 0 or baseline_tokens_per_s <= 0 or eagle3_tokens_per_s <= 0:
        raise ValueError(f"need k >= 1 and positive tau and throughputs (got {k}, {tau}, "
                         f"{baseline_tokens_per_s}, {eagle3_tokens_per_s})")
    return (tau * baseline_tokens_per_s / eagle3_tokens_per_s - 1) / k


# ---------------------------------------------------------------------------------------------------------
# per-round records (format: DESIGN.md, "Acceptance records", repeated in read_records' docstring)

RECORDS = "records.jsonl"


def make_record(
    trace: Any, *, config: str, split: str, drafter: str, aux_layer_ids: Sequence[int], k: int,
    temperature: float, prompt_index: int, prompt_ids: Sequence[int], tokenizer: Any = None,
) -> dict[str, Any]:
    """A JSON-able record of one prompt's rounds (a :class:`eagle3lab.speculate.DecodeTrace`)."""

    def pieces(ids: Sequence[int]) -> list[str]:
        return [tokenizer.decode([int(t)]) for t in ids] if tokenizer is not None else [str(int(t)) for t in ids]

    return {
        "config": config, "split": split, "drafter": drafter, "aux_layer_ids": sorted(int(i) for i in aux_layer_ids),
        "k": int(k), "temperature": float(temperature),
        "source": "decoded" if trace.complete_drafts else "simulated",
        "prompt_index": int(prompt_index), "prompt_ids": [int(t) for t in prompt_ids],
        "prompt_text": tokenizer.decode(list(prompt_ids)) if tokenizer is not None else "",
        "output_ids": [int(t) for t in trace.output], "output_pieces": pieces(trace.output),
        "rounds": [{"start": r.start, "drafted": [int(t) for t in r.drafted], "drafted_pieces": pieces(r.drafted),
                    "accepted": int(r.accepted), "emitted": [int(t) for t in r.emitted]} for r in trace.rounds],
    }


def write_records(path: str | Path, records: Iterable[Mapping[str, Any]], append: bool = False) -> Path:
    """Write (or append) records as JSON lines."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``records.jsonl``: one dict per (configuration, prompt); see DESIGN.md, "Acceptance records".

    Keys: config, split, drafter, aux_layer_ids, k, temperature, source ("decoded" | "simulated"),
    prompt_index, prompt_ids, prompt_text, output_ids, output_pieces, rounds (start, drafted,
    drafted_pieces, accepted, emitted).
    """
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def stats_from_record(record: Mapping[str, Any]) -> SpecDecodeStats:
    """The counters of one record (recomputed from its rounds)."""
    st = SpecDecodeStats(accepted_per_pos=[0] * int(record["k"]), accepted_hist=[0] * (int(record["k"]) + 1))
    for r in record["rounds"]:
        st.record_round(int(record["k"]), int(r["accepted"]))
    return st


# ---------------------------------------------------------------------------------------------------------
# token view

_COLOURS = {"prefill": "#e0e0e0", "accepted": "#b7e4c7", "correction": "#f4c7a1", "bonus": "#a9d3f5"}


def token_view_html(record: Mapping[str, Any], max_prompt_chars: int = 400) -> str:
    """Static HTML (no scripts) of one record: the output with each token coloured by its role.

    Green: a draft the target accepted; orange: the target's correction after a rejected draft, with the
    rejected draft struck through in red before it; blue: the bonus token after all k drafts were accepted;
    grey: the first token (from the prefill, no draft). Hover a token for its round and draft position.
    """
    from html import escape

    def span(text: str, colour: str, tip: str, extra: str = "") -> str:
        shown = escape(text).replace("\n", "↵<br>").replace(" ", "&nbsp;") or "∅"
        return (f'<span title="{escape(tip)}" style="background:{colour};border-radius:3px;'
                f'padding:0 1px;margin:0 1px 0 0;{extra}">{shown}</span>')

    pieces = record["output_pieces"]
    parts = [span(pieces[0], _COLOURS["prefill"], "token 0: from the prefill")] if pieces else []
    k = int(record["k"])
    for n, r in enumerate(record["rounds"]):
        a, emitted, drafted = int(r["accepted"]), r["emitted"], r.get("drafted_pieces") or []
        parts.append('<span style="border-left:2px solid #555;margin:0 2px"></span>')
        for i in range(len(emitted)):
            piece = pieces[r["start"] + i]
            if i < a:
                parts.append(span(piece, _COLOURS["accepted"], f"round {n + 1}, draft {i + 1}: accepted"))
            else:
                if a < k and a < len(drafted):
                    parts.append(span(drafted[a], "#f8d7da", f"round {n + 1}, draft {a + 1}: rejected",
                                      "text-decoration:line-through;color:#a00"))
                role = "bonus" if a == k else "correction"
                parts.append(span(piece, _COLOURS[role], f"round {n + 1}: the target's own token ({role})"))
    legend = " ".join(span(name, c, name) for name, c in
                      [("accepted draft", _COLOURS["accepted"]), ("rejected draft", "#f8d7da"),
                       ("target's correction", _COLOURS["correction"]), ("bonus (all k accepted)", _COLOURS["bonus"]),
                       ("prefill", _COLOURS["prefill"])])
    prompt = escape(str(record.get("prompt_text", ""))[-max_prompt_chars:])
    head = (f"<div><b>{escape(record['config'])}</b>, prompt {record['prompt_index']} "
            f"({record['source']}; bars separate rounds)</div><div>{legend}</div>")
    return (f'<div style="font-family:monospace;font-size:13px;line-height:1.9">{head}'
            f'<div style="color:#666;white-space:pre-wrap;border-bottom:1px dashed #aaa;margin:4px 0">…{prompt}</div>'
            f'<div>{"".join(parts)}</div></div>')


def position_trend(iv: PromptIntervals) -> str:
    """A sentence on how acceptance changes with the draft position, following the numbers."""
    import math

    cond = [c.value for c in iv.conditional]
    cum = [c.value for c in iv.cumulative]
    reached = [(i, c) for i, c in enumerate(cond) if not math.isnan(c)]
    text = (f"The cumulative rate goes from {cum[0]:.2f} to {cum[-1]:.2f}: it can only fall, because a chain "
            "stops at its first rejection. ")
    unreached = [i + 1 for i, c in enumerate(cond) if math.isnan(c)]
    shown = ", ".join("–" if math.isnan(c) else f"{c:.2f}" for c in cond)
    if len(reached) < 2:
        return text + f"The conditional rates ({shown}) have too few reached positions to show a trend."
    first, last = reached[0][1], reached[-1][1]
    # Overlapping intervals of the first and last reached positions: no claim of a trend.
    a, b = iv.conditional[reached[0][0]], iv.conditional[reached[-1][0]]
    if a.lo <= b.hi and b.lo <= a.hi:
        verdict = "are level within their 95% intervals"
    elif last > first:
        verdict = ("rise with the position: a round that survives its first drafts tends to sit in a predictable "
                   "stretch of text")
    else:
        verdict = "fall with the position: later drafts, which run on the drafter's own hidden states, are worse"
    more = f" Position(s) {unreached} were never reached." if unreached else ""
    return text + f"The conditional rates ({shown}) {verdict}.{more}"


def records_for(
    traces: Sequence[Any], prompts: Sequence[Sequence[int]], *, split: str, drafter: str,
    aux_layer_ids: Sequence[int], k: int, temperature: float, tokenizer: Any = None, skip: Iterable[int] = (),
) -> list[dict[str, Any]]:
    """One record per trace (prompt i = ``prompts[i]``), configuration ``split/drafter/k{k}/T{temperature}``;
    prompt indices in ``skip`` are left out (already recorded by a decoded run)."""
    skip = set(skip)
    label = drafter if drafter == "main" else str(sorted(int(i) for i in aux_layer_ids))
    config = f"{split}/{label}/k{k}/T{temperature:g}"
    return [make_record(tr, config=config, split=split, drafter=drafter, aux_layer_ids=aux_layer_ids, k=k,
                        temperature=temperature, prompt_index=i, prompt_ids=prompts[i], tokenizer=tokenizer)
            for i, tr in enumerate(traces) if i not in skip]
