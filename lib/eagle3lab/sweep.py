"""Aux-layer ablation: drafters trained on different sets of target layers, compared on the same prompts.

Pipeline glue (layer 4): it runs the extraction (:mod:`eagle3lab.aux_states.shards`), drafter training
(:mod:`eagle3lab.train`) and the decoders (:mod:`eagle3lab.speculate`), and hands counters to the statistics
(:mod:`eagle3lab.acceptance`). The target's hidden states are extracted ONCE for every layer id (1..L) and
each set of ids is a column selection of them (:class:`SelectedLayers`), so an extra set costs only its
training.

Sets compared by default (:func:`ablation_sets`): the profile's ids; vLLM's default (2, L//2, L-3) where it
does not collapse; the same ids shifted by one layer, the SGLang/vLLM convention slip (SGLang's id i is
vLLM's i+1; a drafter config read in the wrong convention lands one layer off); and contiguous early /
middle / late sets of the same size.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import torch

from eagle3lab.acceptance import PromptIntervals, SpecDecodeStats
from eagle3lab.aux_layers import default_aux_layer_ids
from eagle3lab.aux_states.hooks import decoder_parts
from eagle3lab.aux_states.shards import MANIFEST, HiddenStateDataset, extract_hidden_states
from eagle3lab.drafter import save_drafter
from eagle3lab.speculate import replay_drafter, select_layers
from eagle3lab.train import train_drafter_for_target


@dataclass
class AblationSet:
    """One candidate set of aux ids, or why it was skipped (``ids`` None)."""

    name: str
    ids: list[int] | None
    why: str = ""


def _valid(ids: Sequence[int], num_layers: int) -> str:
    if len(set(ids)) < len(ids):
        return f"{list(ids)} collapses to {len(set(ids))} distinct layers (the drafter's fc would fail)"
    if min(ids) < 1:
        return f"{list(ids)} contains id {min(ids)}: vLLM has no residual stream before layer 1"
    if max(ids) > num_layers:
        return f"{list(ids)} exceeds the last id {num_layers}"
    return ""


def ablation_sets(
    num_layers: int, profile_ids: Sequence[int], extra: Sequence[Sequence[int]] = ()
) -> list[AblationSet]:
    """The sets to compare for a target of ``num_layers`` layers (duplicates merged into the first name)."""
    prof = sorted(int(i) for i in profile_ids)
    n = len(prof)
    mid = max(1, min(num_layers - n + 1, num_layers // 2 - (n - 1) // 2))
    down, up = [i - 1 for i in prof], [i + 1 for i in prof]
    shift = (AblationSet("profile ids - 1 (SGLang id read as vLLM id)", down) if not _valid(down, num_layers)
             else AblationSet("profile ids + 1 (the profile's ids as SGLang ids)", up) if not _valid(up, num_layers)
             else AblationSet("profile ids shifted by one", None, "both shifts leave the valid range"))
    cands = [
        AblationSet("profile", prof),
        AblationSet("vLLM default (2, L//2, L-3)", sorted(default_aux_layer_ids(num_layers))),
        shift,
        AblationSet("early", list(range(1, n + 1))),
        AblationSet("middle", list(range(mid, mid + n))),
        AblationSet("late", list(range(num_layers - n + 1, num_layers + 1))),
        *[AblationSet("acceptance.layer_sweep", sorted(int(i) for i in e)) for e in extra],
    ]
    out: list[AblationSet] = []
    seen: dict[tuple[int, ...], AblationSet] = {}
    for c in cands:
        if c.ids is not None:
            why = _valid(c.ids, num_layers)
            if why:
                out.append(AblationSet(c.name, None, why))
                continue
            key = tuple(c.ids)
            if key in seen:
                seen[key].name += f" = {c.name}"
                continue
            seen[key] = c
        out.append(c)
    return out


class SelectedLayers(torch.utils.data.Dataset):
    """A view of an all-layer :class:`~eagle3lab.aux_states.shards.HiddenStateDataset` with only some aux ids."""

    def __init__(self, all_layers: Any, ids: Sequence[int]) -> None:
        self.base = all_layers
        self.all_ids = list(all_layers.aux_layer_ids)
        self.aux_layer_ids = sorted(int(i) for i in ids)
        self.hidden_size = int(all_layers.hidden_size)
        select_layers(torch.zeros(len(self.all_ids) * self.hidden_size), self.all_ids, self.aux_layer_ids,
                      self.hidden_size)  # fail now on ids that were not stored

    def __len__(self) -> int:
        return len(self.base)

    def get(self, idx: int, keys: Sequence[str] = ("input_ids", "loss_mask", "aux")) -> dict[str, torch.Tensor]:
        """Item ``idx`` with only ``keys`` (the aux columns of the selected ids)."""
        item = self.base.get(idx, keys)
        if "aux" in item:
            item["aux"] = select_layers(item["aux"], self.all_ids, self.aux_layer_ids, self.hidden_size)
        return item

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.get(idx)


def extract_all_layers(engine: Any, samples_path: str | Path, target_path: str | Path, out_dir: str | Path,
                       **extraction_kw: Any) -> Any:
    """Extract every aux id (1..L) of the samples once (resumable); returns the HiddenStateDataset.

    An existing extraction in ``out_dir`` made from other samples or settings is deleted and redone (the
    folder holds nothing else): a rerun with another ``acceptance.layer_samples`` must not fail.
    """
    import shutil

    if not hasattr(engine, "model"):
        raise ValueError("the aux-layer ablation needs the reference engine: it extracts hidden states in-process")
    num_layers = len(decoder_parts(engine.model)[1])
    ids = list(range(1, num_layers + 1))

    def run() -> None:
        extract_hidden_states(engine.model, samples_path, ids, out_dir, target=target_path, device=engine.device,
                              **extraction_kw)

    try:
        run()
    except ValueError:
        if not (Path(out_dir) / MANIFEST).is_file():
            raise
        for p in Path(out_dir).iterdir():  # only the extraction's own files (the samples file may live here)
            if p.name == MANIFEST or p.name.startswith("shard-"):
                p.unlink() if p.is_file() else shutil.rmtree(p)
        run()
    return HiddenStateDataset(out_dir)


@dataclass
class AblationResult:
    """One trained ablation drafter and its acceptance on the shared prompts."""

    name: str
    ids: list[int]
    drafter_path: Path
    stats: SpecDecodeStats
    per_prompt: list[SpecDecodeStats] = field(default_factory=list)
    train_seconds: float = 0.0
    train_accuracy: list[float] = field(default_factory=list)


def train_set(
    target_path: str | Path, all_layers: Any, ids: Sequence[int], out_dir: str | Path, draft_vocab_size: int,
    num_speculative_tokens: int, drafter_kw: Mapping[str, Any] | None = None,
    train_kw: Mapping[str, Any] | None = None, seed: int = 0,
) -> tuple[Any, Any, Path]:
    """Train one drafter on ``ids`` selected from ``all_layers``; returns (drafter, TrainResult, saved folder).

    Checkpoints and the drafter land under ``out_dir`` (``ckpt-<ids>``, ``drafter-<ids>``): resumable.
    """
    tag = "-".join(str(i) for i in sorted(ids))
    out = Path(out_dir)
    drafter, result = train_drafter_for_target(
        target_path, SelectedLayers(all_layers, ids), draft_vocab_size, drafter_kw=dict(drafter_kw or {}),
        train_kw={**(train_kw or {}), "checkpoint_dir": out / f"ckpt-{tag}"}, seed=seed,
    )
    path = save_drafter(drafter, out / f"drafter-{tag}", target_path, num_speculative_tokens)
    return drafter.eval(), result, path


def run_ablation(
    sets: Sequence[AblationSet], target_path: str | Path, all_layers: Any, out_dir: str | Path,
    continuations: Sequence[Any], num_speculative_tokens: int, max_new_tokens: int, eos_token_id: int | None,
    draft_vocab_size: int, drafter_kw: Mapping[str, Any] | None = None, train_kw: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> list[tuple[AblationResult, list[Any]]]:
    """Train a drafter per set (skipped sets: none) and replay it on the same greedy continuations.

    Returns ``(result, traces)`` per trained set, in the order given; ``result.train_seconds`` includes the
    replay.
    """
    out = []
    for s in sets:
        if s.ids is None:
            continue
        t0 = time.perf_counter()
        d, result, path = train_set(target_path, all_layers, s.ids, out_dir, draft_vocab_size, num_speculative_tokens,
                                    drafter_kw, train_kw, seed)
        traces = replay_drafter(d, continuations, [num_speculative_tokens], max_new_tokens, eos_token_id)[
            num_speculative_tokens]
        per = [t.stats for t in traces]
        out.append((AblationResult(s.name, list(s.ids), path, sum(per, SpecDecodeStats()), per,
                                   time.perf_counter() - t0, list(result.final_accuracy)), traces))
    return out


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
    """Acceptance per choice of target layers, measured by the engine's own speculative decoding.

    Every layer is extracted once (``out_dir/hidden-all``); each choice trains a drafter on its columns
    with the same settings and is decoded on the same prompts. Returns ``{"[ids]": stats}`` in the order
    given. The notebook's default ablation uses the cheaper exact greedy replay instead.
    """
    if not layer_choices:
        raise ValueError("layer_choices is empty: nothing to compare")
    out = Path(out_dir)
    all_layers = extract_all_layers(engine, samples_path, target_path, out / "hidden-all",
                                    shard_sequences=shard_sequences, dtype=hidden_dtype)
    results: dict[str, SpecDecodeStats] = {}
    for choice in layer_choices:
        ids = sorted(int(i) for i in choice)
        _, _, path = train_set(target_path, all_layers, ids, out, draft_vocab_size, num_speculative_tokens,
                               drafter_kw, train_kw, seed)
        results[str(ids)] = engine.speculative_generate(prompts, path, num_speculative_tokens, max_new_tokens).stats
    return results


def ablation_figure(
    results: Mapping[str, tuple[Sequence[int], PromptIntervals]], num_layers: int, reference: str | None = None
) -> go.Figure:
    """Left: which layer ids each set uses, coloured by its τ; right: τ with 95% intervals, best on top."""
    from plotly.subplots import make_subplots

    ranked = sorted(results.items(), key=lambda kv: kv[1][1].tau.value)
    names = [f"{n} {sorted(ids)}" for n, (ids, _) in ranked]
    taus = [iv.tau.value for _, (_, iv) in ranked]
    cols = list(range(1, num_layers + 1))
    z = [[iv.tau.value if c in ids else None for c in cols] for _, (ids, iv) in ranked]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.45, 0.55], horizontal_spacing=0.02)
    fig.add_heatmap(x=cols, y=names, z=z, colorscale="Viridis", zmin=min(taus), zmax=max(taus),
                    colorbar={"title": "τ", "x": 1.02}, hoverongaps=False, row=1, col=1)
    fig.add_bar(x=taus, y=names, orientation="h", text=[f"{t:.2f}" for t in taus], textposition="outside",
                error_x={"type": "data", "symmetric": False,
                         "array": [iv.tau.hi - iv.tau.value for _, (_, iv) in ranked],
                         "arrayminus": [iv.tau.value - iv.tau.lo for _, (_, iv) in ranked]},
                marker_color=["#d62728" if reference and n.startswith(reference) else "#1f77b4" for n, _ in ranked],
                showlegend=False, row=1, col=2)
    fig.update_xaxes(title_text="vLLM aux id (input of layer k)", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="τ (95% interval over prompts)", range=[1, max(t for t in taus) * 1.15 + 0.1],
                     row=1, col=2)
    fig.update_layout(title="Aux-layer ablation: same data, same training budget, same held-out prompts",
                      height=120 + 45 * len(names), margin={"l": 10})
    return fig


def budgeted(train_kw: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Training settings capped at ``steps`` optimizer steps (warmup at most a quarter of them, one checkpoint
    at the end): the same reduced budget for every ablation drafter."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kw = dict(train_kw)
    kw["max_steps"] = min(steps, kw.get("max_steps") or steps)
    kw["warmup"] = min(int(kw.get("warmup", 0)), kw["max_steps"] // 4)
    kw["checkpoint_every"] = kw["max_steps"]
    # A checkpoint of other settings (a rerun with another budget) is restarted, not refused: these drafters
    # are cheap products of the all-layer states.
    kw["on_mismatch"] = "restart"
    return kw
