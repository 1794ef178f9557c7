"""Acceptance statistics of speculative decoding, in vLLM's terms, and their figures.

The counters are the ones vLLM exports (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``), so numbers from our reference decoder
and from a vLLM engine can sit in one table:

- mean acceptance length = 1 + accepted / drafts (the target's own token counts as one per round);
- per-position acceptance rate i = accepted_per_pos[i] / drafts (fraction of rounds whose draft i was
  accepted; it can only fall with i because acceptance stops at the first mismatch);
- draft acceptance rate = accepted / draft tokens.
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


def sweep_aux_layers(
    engine: Any,
    samples_path: str | Path,
    target_path: str | Path,
    layer_choices: Sequence[Sequence[int]],
    prompts: list[list[int]],
    out_dir: str | Path,
    num_speculative_tokens: int,
    max_new_tokens: int,
    draft_vocab_size: int,
    drafter_kw: dict[str, Any] | None = None,
    train_kw: dict[str, Any] | None = None,
    shard_sequences: int = 64,
    hidden_dtype: str = "float32",
    seed: int = 0,
) -> dict[str, SpecDecodeStats]:
    """Acceptance per choice of target layers: for each choice, extract its aux states from the same
    samples, train a drafter on them with the same settings, and measure it on the same prompts.

    ``engine`` must be the reference engine (the extraction runs its transformers model in-process).
    Everything lands under ``out_dir`` (``hidden-<ids>``, ``ckpt-<ids>``, ``drafter-<ids>``), so an
    interrupted sweep resumes where it stopped. Returns ``{"[ids]": stats}`` in the order given.
    """
    from eagle3lab.drafter import save_drafter
    from eagle3lab.hidden_states import HiddenStateDataset, extract_hidden_states
    from eagle3lab.train import train_drafter_for_target

    if not hasattr(engine, "model"):
        raise ValueError("a layer sweep needs the reference engine: it extracts hidden states in-process")
    if not layer_choices:
        raise ValueError("layer_choices is empty: nothing to compare")
    out = Path(out_dir)
    results: dict[str, SpecDecodeStats] = {}
    for choice in layer_choices:
        ids = sorted(int(i) for i in choice)
        tag = "-".join(str(i) for i in ids)
        hdir = out / f"hidden-{tag}"
        extract_hidden_states(engine.model, samples_path, ids, hdir, shard_sequences=shard_sequences,
                              dtype=hidden_dtype, target=target_path, device=engine.device)
        drafter, _ = train_drafter_for_target(
            target_path, HiddenStateDataset(hdir), draft_vocab_size, drafter_kw=drafter_kw,
            train_kw={**(train_kw or {}), "checkpoint_dir": out / f"ckpt-{tag}"}, seed=seed,
        )
        dpath = save_drafter(drafter, out / f"drafter-{tag}", target_path, num_speculative_tokens)
        results[str(ids)] = engine.speculative_generate(prompts, dpath, num_speculative_tokens, max_new_tokens).stats
    return results
