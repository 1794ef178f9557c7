"""What a notebook holds while it runs: the validated params, the run folder, artifacts, metrics.

Every notebook starts with ``wb = open_workbook("03_engine", params, run_dir)`` right after its
``parameters`` cell. Under ``eagle3lab run`` papermill injects ``params`` (the validated profile as a
dict) and ``run_dir``; in JupyterLab both are left at ``None`` and the workbook uses
``params/embedded.yaml`` (or ``params_file``) and the folder ``outputs/lab-<profile>/``, shared by
the notebooks of one interactive session.

Metrics are written at once, one JSON file per notebook under ``<run>/metrics/``, so that nothing
recorded before a crash is lost; the runner merges them into ``<run>/metrics.json``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lab import params as params_mod


def repo_root(start: Path | None = None) -> Path:
    """The folder holding ``params/`` and ``notebooks/`` (searched upwards from ``start`` or cwd)."""
    env = os.environ.get("EAGLE3LAB_ROOT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "params").is_dir() and (d / "notebooks").is_dir():
            return d
    return here


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass
class Workbook:
    """The context of one notebook in one run."""

    notebook: str
    params: params_mod.Params
    run_dir: Path
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def artifacts(self) -> Path:
        """Folder shared by the notebooks of the run for models, data and checkpoints."""
        p = self.run_dir / "artifacts"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def artifact(self, *parts: str) -> Path:
        """Path of an artifact (its parent folder is created)."""
        p = self.artifacts.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def target_path(self) -> Path:
        """The target checkpoint: the user's for checkpoint profiles, 00_target's output otherwise."""
        t = self.params.target
        if t.source == "checkpoint":
            return Path(t.path)
        return self.artifacts / "target"

    def record(self, key: str, value: Any) -> Any:
        """Record a metric (JSON-able: numbers, strings, lists, dicts) and persist it at once."""
        self.metrics[key] = _jsonable(value)
        path = self.run_dir / "metrics" / f"{self.notebook}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.metrics, indent=2, sort_keys=True))
        tmp.replace(path)
        return value

    def recorded(self, notebook: str | None = None) -> dict[str, Any]:
        """Metrics recorded so far in this run by ``notebook`` (default: all notebooks, merged)."""
        return read_metrics(self.run_dir, notebook)


def read_metrics(run_dir: str | Path, notebook: str | None = None) -> dict[str, Any]:
    """Read recorded metrics back: one notebook's, or all of them merged as ``{notebook: {...}}``."""
    mdir = Path(run_dir) / "metrics"
    if notebook is not None:
        p = mdir / f"{notebook}.json"
        return json.loads(p.read_text()) if p.is_file() else {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(mdir.glob("*.json"))}


def open_workbook(
    notebook: str,
    params: dict[str, Any] | None = None,
    run_dir: str | Path | None = None,
    params_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Workbook:
    """Open the context for ``notebook``; see the module docstring for the two ways it is called."""
    from eagle3lab import report

    root = repo_root()
    if params is not None:
        p = params_mod.validate(params, f"injected parameters of {notebook}")
    else:
        p = params_mod.load(params_file or root / "params" / "embedded.yaml", overrides)
    rd = Path(run_dir) if run_dir else root / "outputs" / f"lab-{p.profile}"
    rd.mkdir(parents=True, exist_ok=True)
    report.setup_notebook_display()
    return Workbook(notebook=notebook, params=p, run_dir=rd.resolve(), metrics=read_metrics(rd, notebook))
