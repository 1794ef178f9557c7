"""The drafter-data pipeline in figures: generate, extract, train; from a run, from the seed, projected.

A drafter needs three stages before it can be served: the target **generates** the samples (prompt +
response), the target's aux hidden states are **extracted** for every sample token and written to disk, and
the drafter is **trained** on them for some epochs. This module reads each stage's wall time, tokens,
tokens/s and bytes from a workbook run's ``metrics.json`` and ``params.yaml`` (03_engine, 04_train_drafter),
puts the seed deployment's figures beside them (:data:`SEED`: Kimi-K2.5, reported, approximate) and projects
our measured per-token costs to another target's widths (:func:`project`), each rule of the projection
written out as an assumption string.

One unit runs through all three stages: the **sample token** (prompt + response: what the drafter trains on
and what the aux states are stored for). It is the only unit the seed's figures give (its 828 GB of aux
states are a count of sample tokens), so ours is read in it too: the generate stage's tokens/s is sample
tokens per second, not the response tokens per second that 03 records as ``data.generate_tokens_per_s``.
The train stage counts token passes (sample tokens x epochs), so that its tokens/s is what one training pass
sustains.

A figure a run did not record is ``None``, never an error: a resumed run may skip generation (03 records
0 s then), an older run may lack a key. The arithmetic is kept plain on purpose: every projected number is
a measured per-token cost times a ratio that :attr:`Projection.assumptions` names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

STAGES = ("generate", "extract", "train")
HOUR = 3600.0
GB = 1e9  # the seed's "828 GB" read as decimal gigabytes (GiB would give 7% more tokens)
# Bytes per stored value of 03's data.hidden_dtype (params.py allows these three).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The moonshot's goals against the seed: a quarter of its wall time, a tenth of its disk.
WALL_GOAL = 1 / 4
DISK_GOAL = 1 / 10


@dataclass(frozen=True)
class Stage:
    """One stage's figures: wall seconds, sample tokens (token passes for train), tokens/s, bytes on disk.

    ``bytes`` is what the stage leaves on disk that matters: the aux hidden states for ``extract``;
    ``None`` for ``generate`` (the samples are token ids, small beside the states) and ``train`` (one
    drafter checkpoint) unless a run records it. Any figure may be ``None``: not recorded.
    """

    name: str
    seconds: float | None
    tokens: float | None
    tokens_per_s: float | None
    bytes: float | None = None

    @property
    def seconds_per_token(self) -> float | None:
        """Wall seconds per token: the per-token cost a projection scales."""
        if self.seconds is None or not self.tokens:
            return None
        return self.seconds / self.tokens

    def metrics(self, prefix: str = "pipeline") -> dict[str, float | None]:
        """The figures as flat metric keys (``pipeline.extract.bytes``), the form of ``wb.record`` and
        metrics.json."""
        keys = ("seconds", "tokens", "tokens_per_s", "bytes")
        return {f"{prefix}.{self.name}.{k}": getattr(self, k) for k in keys}


def make_stage(name: str, seconds: float | None, tokens: float | None, bytes: float | None = None) -> Stage:
    """A stage whose tokens/s is derived from its seconds and tokens (``None`` unless both are known)."""
    if name not in STAGES:
        raise ValueError(f"stage {name!r}: expected one of {', '.join(STAGES)}")
    rate = tokens / seconds if seconds and tokens is not None else None
    return Stage(name, seconds, tokens, rate, bytes)


# ---------------------------------------------------------------------------------------------------------
# target shapes


@dataclass(frozen=True)
class TargetShape:
    """What the pipeline's cost depends on in a target: its width and depth, the parameters active per
    token, how many aux layers are stored at how many bytes a value, and the GPUs it runs on (tensor
    parallel)."""

    hidden_size: int
    num_layers: int
    active_params: float
    num_aux: int
    bytes_per_value: int
    gpus: int = 1

    @property
    def bytes_per_token(self) -> int:
        """Aux-state bytes per sample token: num_aux x hidden_size x bytes_per_value. Exact: it is the
        format (one hidden vector per aux layer per token); shard headers and token ids add a fraction of a
        percent."""
        return self.num_aux * self.hidden_size * self.bytes_per_value


# Kimi-K2.5 as the seed deployed it: hidden 7168, 61 layers, 32 B active parameters per token (of 1 T, MoE),
# 3 aux layers stored in bf16, on 8 GPUs with tensor parallelism.
KIMI_K25 = TargetShape(hidden_size=7168, num_layers=61, active_params=32e9, num_aux=3, bytes_per_value=2,
                       gpus=8)


# ---------------------------------------------------------------------------------------------------------
# the seed


@dataclass(frozen=True)
class SeedPipeline:
    """The seed deployment's pipeline: Kimi-K2.5 on 8x RTX PRO 6000 Blackwell.

    These are the seed's reported figures (``../shared/seeds/``, accounts of the original debugging
    session), and approximate: "10,000 inference samples, ~5.3 hours", "hidden state extraction at 3,165
    tok/s producing 828 GB", "a 5-epoch fine-tuning run (2.6 hours)". The seed gives no token count and no
    extraction time: both are derived here, tokens from the bytes and the format
    (``hidden_bytes / shape.bytes_per_token``), extraction seconds as tokens / tokens per second.
    """

    samples: int = 10_000
    generate_hours: float = 5.3
    extract_tokens_per_s: float = 3165.0
    hidden_bytes: float = 828 * GB
    train_hours: float = 2.6
    epochs: int = 5
    shape: TargetShape = KIMI_K25
    gpu: str = "RTX PRO 6000 Blackwell"

    @property
    def tokens(self) -> float:
        """Sample tokens, derived: the stored bytes over the format's bytes per token."""
        return self.hidden_bytes / self.shape.bytes_per_token

    @property
    def tokens_per_sample(self) -> float:
        """Mean sample length (prompt + response), derived from :attr:`tokens`."""
        return self.tokens / self.samples

    @property
    def generate_seconds(self) -> float:
        return self.generate_hours * HOUR

    @property
    def extract_seconds(self) -> float:
        """Derived: tokens / the reported extraction rate."""
        return self.tokens / self.extract_tokens_per_s

    @property
    def train_seconds(self) -> float:
        return self.train_hours * HOUR

    @property
    def total_seconds(self) -> float:
        """Wall time of the three stages run one after the other."""
        return self.generate_seconds + self.extract_seconds + self.train_seconds

    def stages(self) -> list[Stage]:
        """The seed's three stages, in this module's units (sample tokens; token passes for train)."""
        return [
            make_stage("generate", self.generate_seconds, self.tokens),
            Stage("extract", self.extract_seconds, self.tokens, self.extract_tokens_per_s, self.hidden_bytes),
            make_stage("train", self.train_seconds, self.tokens * self.epochs),
        ]


SEED = SeedPipeline()


# ---------------------------------------------------------------------------------------------------------
# a run's stages


def _steps(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-step metrics: metrics.json's ``metrics`` section, or that section itself."""
    inner = metrics.get("metrics")
    return inner if isinstance(inner, dict) else metrics


def _number(steps: dict[str, dict[str, Any]], step: str, key: str) -> float | None:
    """A recorded positive, finite number, else ``None``: missing, 0 (03 records 0 s when generation was
    skipped), NaN (a rate over 0 s) and non-numbers all mean "not measured"."""
    value = steps.get(step, {}).get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _param(params: dict[str, Any], dotted: str) -> Any:
    """A value of params.yaml by dotted path, ``None`` where any part is missing."""
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def epochs_done(metrics: dict[str, Any], params: dict[str, Any]) -> float | None:
    """Epochs 04 trained: its steps over the steps of one epoch (ceil(samples / batch_size), as
    ``train_drafter`` counts them), so that a ``train.max_steps`` that cut the schedule short is seen;
    the params' ``train.epochs`` where a figure is missing."""
    steps = _steps(metrics)
    done = _number(steps, "04_train_drafter", "train.steps")
    samples = _number(steps, "03_engine", "data.num_samples")
    batch = _param(params, "train.batch_size")
    if done and samples and isinstance(batch, int) and batch > 0:
        return done / math.ceil(samples / batch)
    epochs = _param(params, "train.epochs")
    return float(epochs) if isinstance(epochs, (int, float)) and epochs > 0 else None


def stages_from_metrics(metrics: dict[str, Any], params: dict[str, Any]) -> list[Stage]:
    """generate, extract, train from a run's metrics.json (whole, or its ``metrics`` section) and
    params.yaml.

    - generate: ``data.generate_seconds`` (else response tokens / ``data.generate_tokens_per_s``) over
      the sample tokens ``data.tokens``;
    - extract: ``hidden.seconds`` where recorded, else ``data.tokens / hidden.tokens_per_s``; bytes
      ``hidden.bytes``;
    - train: ``train.seconds`` over ``data.tokens`` x :func:`epochs_done` token passes.
    """
    steps = _steps(metrics)
    tokens = _number(steps, "03_engine", "data.tokens")

    gen_s = _number(steps, "03_engine", "data.generate_seconds")
    response = _number(steps, "03_engine", "data.response_tokens")
    response_rate = _number(steps, "03_engine", "data.generate_tokens_per_s")
    if gen_s is None and response and response_rate:
        gen_s = response / response_rate

    ext_s = _number(steps, "03_engine", "hidden.seconds")
    ext_rate = _number(steps, "03_engine", "hidden.tokens_per_s")
    if ext_s is None and tokens and ext_rate:
        ext_s = tokens / ext_rate

    epochs = epochs_done(metrics, params)
    passes = tokens * epochs if tokens and epochs else None
    return [
        make_stage("generate", gen_s, tokens),
        make_stage("extract", ext_s, tokens, _number(steps, "03_engine", "hidden.bytes")),
        make_stage("train", _number(steps, "04_train_drafter", "train.seconds"), passes),
    ]


def shape_from_metrics(metrics: dict[str, Any], params: dict[str, Any]) -> TargetShape:
    """The measured target's shape: width and depth of the embedded target (params), active parameters
    (00), aux layers (03, else the drafter's params), stored dtype and tensor-parallel GPUs (params).

    ``gpus`` is ``engine.tensor_parallel_size``: the generating engine's GPUs. Raises ValueError naming what
    is missing: without the shape there is nothing to scale from.
    """
    steps = _steps(metrics)
    aux = steps.get("03_engine", {}).get("hidden.aux_layer_ids") or _param(params, "drafter.aux_layer_ids")
    values = {
        "hidden_size": _param(params, "target.embedded.hidden_size"),
        "num_layers": _number(steps, "00_target", "target.num_layers")
        or _param(params, "target.embedded.num_hidden_layers"),
        "active_params": _number(steps, "00_target", "target.active_params"),
        "num_aux": len(aux) if isinstance(aux, list) and aux else None,
        "bytes_per_value": DTYPE_BYTES.get(_param(params, "data.hidden_dtype")),
        "gpus": _param(params, "engine.tensor_parallel_size") or 1,
    }
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ValueError(f"the run does not give the target's {', '.join(missing)}")
    return TargetShape(hidden_size=int(values["hidden_size"]), num_layers=int(values["num_layers"]),
                       active_params=float(values["active_params"]), num_aux=int(values["num_aux"]),
                       bytes_per_value=int(values["bytes_per_value"]), gpus=int(values["gpus"]))


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run folder's metrics.json and params.yaml (``{}`` for a missing params.yaml). A run cut before the runner
    wrote metrics.json still has each step's ``metrics/<notebook>.json``: those are read instead."""
    run_dir = Path(run_dir)
    summary = run_dir / "metrics.json"
    if summary.is_file():
        metrics = json.loads(summary.read_text())
    else:
        steps = sorted((run_dir / "metrics").glob("*.json"))
        if not steps:
            raise FileNotFoundError(f"{run_dir}: neither metrics.json nor metrics/*.json")
        metrics = {"metrics": {p.stem: json.loads(p.read_text()) for p in steps}}
    params_path = run_dir / "params.yaml"
    params = yaml.safe_load(params_path.read_text()) if params_path.is_file() else {}
    return metrics, params or {}


def stages_from_run(run_dir: str | Path) -> list[Stage]:
    """:func:`stages_from_metrics` of a run folder."""
    return stages_from_metrics(*read_run(run_dir))


def shape_from_run(run_dir: str | Path) -> TargetShape:
    """:func:`shape_from_metrics` of a run folder."""
    return shape_from_metrics(*read_run(run_dir))


# ---------------------------------------------------------------------------------------------------------
# the projection


@dataclass(frozen=True)
class Projection:
    """Projected stages for another target and workload, and the assumptions that made them, one per rule."""

    stages: list[Stage]
    assumptions: list[str] = field(default_factory=list)

    def stage(self, name: str) -> Stage:
        return _by_name(self.stages)[name]

    @property
    def total_seconds(self) -> float | None:
        """The three stages one after the other; ``None`` if any is unknown."""
        return _total_seconds(self.stages)

    @property
    def disk_bytes(self) -> float | None:
        """The aux states on disk: the extract stage's bytes."""
        return self.stage("extract").bytes


def _by_name(stages: list[Stage]) -> dict[str, Stage]:
    by = {s.name: s for s in stages}
    missing = [n for n in STAGES if n not in by]
    if missing:
        raise ValueError(f"stages {', '.join(missing)} missing")
    return by


def _total_seconds(stages: list[Stage]) -> float | None:
    seconds = [s.seconds for s in stages]
    return None if any(x is None for x in seconds) else sum(x for x in seconds if x is not None)


def _scaled(per_token: float | None, tokens: float, factor: float) -> float | None:
    """Seconds for ``tokens`` at a measured ``per_token`` cost times ``factor``."""
    return None if per_token is None else tokens * per_token * factor


def project(stages: list[Stage], ours: TargetShape, to: TargetShape, samples: int, tokens_per_sample: float,
            epochs: int) -> Projection:
    """Our measured stages carried to target ``to`` and a workload of ``samples`` x ``tokens_per_sample``
    sample tokens, trained for ``epochs``.

    Each stage keeps its measured seconds per token and multiplies it by one ratio:

    - generate, extract: active parameters per token, ``to / ours`` (a forward pass costs about 2 x active
      parameters FLOPs a token), divided by the GPU ratio ``to.gpus / ours.gpus`` (ideal tensor
      parallelism);
    - train: ``(to.hidden_size / ours.hidden_size) ** 2`` per token pass (the drafter is one decoder layer
      at the target's width: its cost goes as hidden^2), epochs x sample tokens passes;
    - bytes: ``to.bytes_per_token`` per sample token (the format: exact).

    :attr:`Projection.assumptions` says each rule with its numbers, and what it leaves out.
    """
    by = _by_name(stages)
    tokens = samples * tokens_per_sample
    passes = tokens * epochs
    infer = (to.active_params / ours.active_params) / (to.gpus / ours.gpus)
    width = (to.hidden_size / ours.hidden_size) ** 2
    gen, ext, train = by["generate"], by["extract"], by["train"]
    projected = [
        make_stage("generate", _scaled(gen.seconds_per_token, tokens, infer), tokens),
        make_stage("extract", _scaled(ext.seconds_per_token, tokens, infer), tokens,
                   tokens * to.bytes_per_token),
        make_stage("train", _scaled(train.seconds_per_token, passes, width), passes),
    ]
    return Projection(projected, assumptions(by, ours, to, samples, tokens_per_sample, epochs))


def assumptions(by: dict[str, Stage], ours: TargetShape, to: TargetShape, samples: int,
                tokens_per_sample: float, epochs: int) -> list[str]:
    """The projection's rules as sentences, one per assumption, with the numbers each one used."""
    tokens = samples * tokens_per_sample
    active = to.active_params / ours.active_params
    gpus = to.gpus / ours.gpus
    width = (to.hidden_size / ours.hidden_size) ** 2
    ext, gen_rate = by["extract"], by["generate"].tokens_per_s
    stored = ""
    if ext.bytes and ext.tokens:
        stored = (f"; our run stored {ext.bytes / ext.tokens:,.1f} B/token against its format's "
                  f"{ours.bytes_per_token:,} (shard headers, token ids: left out)")
    overhead = ""
    if gen_rate:
        overhead = (f"; our generation ran at {2 * ours.active_params * gen_rate / 1e12:.2f} TFLOP/s "
                    "(2 x active x tokens/s), far below a GPU's peak, so part of our per-token time is fixed "
                    "overhead that this rule multiplies too (pessimistic)")
    return [
        f"workload: sample tokens = samples x tokens_per_sample = {samples:,} x {tokens_per_sample:,.1f} = "
        f"{tokens / 1e6:,.2f} M (prompt + response); a sample's prompt/response mix as in our run (prompt "
        "tokens are prefilled together, response tokens decoded one step each: another mix moves "
        "generation's cost)",
        f"bytes/token = num_aux x hidden x bytes_per_value = {to.num_aux} x {to.hidden_size:,} x "
        f"{to.bytes_per_value} = {to.bytes_per_token:,} B (exact: it is the format){stored}",
        f"generation and extraction: seconds per token scale with active parameters per token, "
        f"{to.active_params:.4g} / {ours.active_params:.4g} = {active:,.1f}x (MoE routing and all-to-all, "
        f"attention's share and the KV cache left out){overhead}",
        f"GPU count: generation and extraction divided by {to.gpus} / {ours.gpus} = {gpus:g} (ideal "
        "tensor-parallel scaling, optimistic: no all-reduce or all-to-all cost, every GPU as busy as one "
        "alone)",
        "stage times as the run recorded them: 03's generation time includes the engine's start (and, compiled, "
        "its torch.compile and CUDA-graph capture), and 03's in-engine extraction runs one sequence per request; "
        "fixed costs like these are multiplied by the per-token rules too (pessimistic for a short run)",
        f"training: seconds per token pass scale with the drafter's width squared, one decoder layer at the "
        f"target's width: ({to.hidden_size:,} / {ours.hidden_size:,})^2 = {width:,.1f}x, per epoch, "
        f"{epochs} epochs (the draft vocabulary's head, linear in hidden, and sequence length left out); "
        "on as many GPUs as our training used (no data parallelism assumed)",
        f"GPU type: the same as the measured run's (each projected GPU as fast as ours); the seed's figures "
        f"come from {SEED.gpu} GPUs, so a projected / seed ratio compares GPU types too",
    ]


# ---------------------------------------------------------------------------------------------------------
# the table and the goals


def _figures(prefix: str, stage: Stage) -> dict[str, float | None]:
    return {f"{prefix} s": stage.seconds, f"{prefix} tok/s": stage.tokens_per_s,
            f"{prefix} bytes": stage.bytes}


def _texts(label: str, stage: Stage) -> dict[str, str]:
    return {f"{label}: wall": _seconds_text(stage.seconds), f"{label}: tokens/s": _rate_text(stage.tokens_per_s),
            f"{label}: bytes": _bytes_text(stage.bytes)}


def _total(stages: list[Stage]) -> Stage:
    """The pipeline as one row: seconds summed (``None`` if any is unknown), the known bytes summed."""
    known = [s.bytes for s in stages if s.bytes is not None]
    return Stage("total", _total_seconds(stages), None, None, sum(known) if known else None)


def pipeline_rows(ours: list[Stage], seed: SeedPipeline, projection: Projection | None,
                  text: bool = False) -> list[dict[str, Any]]:
    """One row per stage and a total: wall seconds, tokens/s and bytes of our run, the seed, and the projection
    (its columns only with one). ``text``: the page's form, under "this run: wall" and the like, seconds past an
    hour in hours and bytes in kB to GB; otherwise the numbers, under "ours s" and the like."""
    cell, own = (_texts, "this run") if text else (_figures, "ours")
    columns = [(own, ours), ("seed", seed.stages())]
    if projection is not None:
        columns.append(("projected", projection.stages))
    rows = []
    for name in (*STAGES, "total"):
        row: dict[str, Any] = {"stage": name}
        for label, stages in columns:
            row.update(cell(label, _total(stages) if name == "total" else _by_name(stages)[name]))
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Goal:
    """One goal against the seed: projected / seed, met at or below ``goal`` (``None``: not computable)."""

    name: str
    projected: float | None
    seed: float
    goal: float

    @property
    def ratio(self) -> float | None:
        return None if self.projected is None else self.projected / self.seed

    @property
    def met(self) -> bool | None:
        return None if self.ratio is None else self.ratio <= self.goal

    def row(self) -> dict[str, Any]:
        return {"goal": self.name, "projected": self.projected, "seed": self.seed, "ratio": self.ratio,
                "target ratio": self.goal, "met": self.met}


def moonshot(projection: Projection, seed: SeedPipeline = SEED) -> list[Goal]:
    """The projection against the seed's goals: total wall time at 1/4 of the seed's, aux-state disk at
    1/10 of it."""
    return [
        Goal("wall time (s)", projection.total_seconds, seed.total_seconds, WALL_GOAL),
        Goal("disk (bytes)", projection.disk_bytes, seed.hidden_bytes, DISK_GOAL),
    ]


# ---------------------------------------------------------------------------------------------------------
# 04's section


def _seconds_text(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= HOUR:
        return f"{s / HOUR:,.2f} h"
    return f"{s:,.1f} s" if s >= 10 else f"{s:.2f} s"


def _bytes_text(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b:,.0f} B"


def _rate_text(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f}" if r >= 10 else f"{r:.3g}"


@dataclass(frozen=True)
class PipelineReport:
    """04's last section: this run's stages, the seed's, and the projection to Kimi-K2.5 where one is meaningful
    (``reason`` says why not, otherwise)."""

    stages: list[Stage]
    projection: Projection | None
    reason: str | None = None
    seed: SeedPipeline = SEED

    def metrics(self) -> dict[str, Any]:
        """``pipeline.<stage>.*`` of this run, and the projection's totals and goal ratios when there is one."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.metrics())
        if self.projection is not None:
            out["pipeline.kimi_projection.seconds"] = self.projection.total_seconds
            out["pipeline.kimi_projection.bytes"] = self.projection.disk_bytes
            for goal in moonshot(self.projection, self.seed):
                out[f"pipeline.kimi_projection.{goal.name.split()[0]}_over_seed"] = goal.ratio
        return out

    def rows(self) -> list[dict[str, str]]:
        """The stage table as the page shows it (:func:`pipeline_rows` as text)."""
        return pipeline_rows(self.stages, self.seed, self.projection, text=True)

    def goal_rows(self) -> list[dict[str, Any]]:
        """The moonshot (a quarter of the seed's wall time, a tenth of its disk), projected; empty without a
        projection."""
        if self.projection is None:
            return []
        return [{"goal": g.name.split(" (")[0], "projected / seed": None if g.ratio is None else round(g.ratio, 3),
                 "goal ratio": g.goal, "met": g.met} for g in moonshot(self.projection, self.seed)]


def report_for_run(metrics: dict[str, Any], params: dict[str, Any], to: TargetShape = KIMI_K25,
                   seed: SeedPipeline = SEED) -> PipelineReport:
    """The section for a run's metrics and params: the projection to ``to`` with the seed's workload only from a
    GPU run (a CPU's per-token costs say nothing of a GPU cluster's) of a target whose shape the run gives."""
    stages = stages_from_metrics(metrics, params)
    device = str(_param(params, "engine.device") or "cpu")
    if not device.startswith("cuda"):
        return PipelineReport(stages, None, f"the projection scales a GPU run's per-token costs; this run ran on "
                                            f"{device}", seed)
    try:
        shape = shape_from_metrics(metrics, params)
    except ValueError as err:  # a checkpoint target (no embedded widths) or a run cut before 03
        return PipelineReport(stages, None, str(err), seed)
    return PipelineReport(stages, project(stages, shape, to, seed.samples, seed.tokens_per_sample, seed.epochs),
                          None, seed)
