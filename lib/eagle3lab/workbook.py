"""What a notebook holds while it runs: the validated params, the run folder, artifacts, metrics.

Every notebook starts with ``wb = open_workbook("03_engine", params, run_dir)`` right after its
``parameters`` cell. Under ``eagle3lab run`` papermill injects ``params`` (the validated profile as a
dict) and ``run_dir``; in JupyterLab both are left at ``None``: the workbook then uses ``params_file``
if given, else ``$EAGLE3LAB_PARAMS``, else the profile last chosen in the profile picker (remembered in
``outputs/.lab-profile``), else ``params/embedded.yaml``, and shows the picker so that the reader sees
which profile ran and can choose another. Its folder is ``outputs/lab-<profile>/``, shared by the
notebooks of one interactive session.

``engine.env`` (environment variables for every vLLM process of the run) is exported into the kernel's
environment when the workbook opens, before any engine, probe or server starts: they all inherit it.

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
from eagle3lab import report

CONCLUSION_KEY = "conclusion"  # per notebook: Workbook.conclude
CAVEATS_KEY = "caveats"  # per notebook: Workbook.caveat
LAB_CHOICE = Path("outputs") / ".lab-profile"  # the profile picked in JupyterLab, relative to the repo root


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

    def record(self, key: str, value: Any) -> None:
        """Record a metric (JSON-able: numbers, strings, lists, dicts) and persist it at once.

        Returns None, so that a cell ending in ``wb.record(...)`` shows no stray ``Out[]`` value.
        """
        self.metrics[key] = _jsonable(value)
        path = self.run_dir / "metrics" / f"{self.notebook}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.metrics, indent=2, sort_keys=True))
        tmp.replace(path)

    def conclude(self, sentence: str) -> None:
        """The step's conclusion in one sentence, shown on its line of the run's index page."""
        self.record(CONCLUSION_KEY, sentence)

    def caveat(self, text: str) -> None:
        """A caveat about the run's data or figures, shown in a banner at the top of the index page."""
        have = list(self.metrics.get(CAVEATS_KEY, []))
        if text not in have:
            self.record(CAVEATS_KEY, [*have, text])

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
    root = repo_root()
    if params is not None:
        p = params_mod.validate(params, f"injected parameters of {notebook}")
    else:
        pfile = lab_params_file(root, params_file)
        p = params_mod.load(pfile, overrides)
        show_profile_picker(root, pfile)
    export_engine_env(p)
    rd = Path(run_dir) if run_dir else root / "outputs" / f"lab-{p.profile}"
    rd.mkdir(parents=True, exist_ok=True)
    report.setup_notebook_display(rd / "logs")
    return Workbook(notebook=notebook, params=p, run_dir=rd.resolve(), metrics=read_metrics(rd, notebook))


def export_engine_env(p: params_mod.Params) -> dict[str, str]:
    """Put ``engine.env`` into this process's environment (the notebook kernel's), so that every engine, probe
    and server a notebook starts inherits it; returns what was set. Run by :func:`open_workbook`."""
    os.environ.update(p.engine.env)
    return dict(p.engine.env)


def profiles(root: Path) -> list[Path]:
    """The parameter profiles a reader can pick: ``params/*.yaml``."""
    return sorted((root / "params").glob("*.yaml"))


def lab_params_file(root: Path, params_file: str | Path | None = None) -> Path:
    """The profile for interactive use: the argument, ``$EAGLE3LAB_PARAMS``, the picker's last choice,
    or ``params/embedded.yaml`` (the first that is set; a remembered choice that vanished is ignored)."""
    if params_file:
        return Path(params_file)
    if os.environ.get("EAGLE3LAB_PARAMS"):
        return Path(os.environ["EAGLE3LAB_PARAMS"])
    choice = root / LAB_CHOICE
    if choice.is_file():
        picked = Path(choice.read_text().strip())
        if picked.is_file():
            return picked
    return root / "params" / "embedded.yaml"


def show_profile_picker(root: Path, current: Path) -> None:
    """Show which profile this notebook runs and a menu to pick another for the next run.

    A running cell cannot wait for a click, so the choice is remembered (``outputs/.lab-profile``) and
    takes effect when the notebooks are run again. The output carries a static line too, which is what
    an HTML export shows. Does nothing outside a Jupyter kernel or without ipywidgets.
    """
    try:
        import ipywidgets as widgets
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or "IPKernelApp" not in shell.config:
        return
    options = [(p.stem, str(p.resolve())) for p in profiles(root)]
    cur = str(Path(current).resolve())
    if cur not in [v for _, v in options]:
        options.append((Path(current).stem, cur))
    menu = widgets.Dropdown(options=options, value=cur, description="profile")
    status = widgets.HTML(f"running <b>{Path(current).stem}</b> ({current})")

    def picked(change: dict[str, Any]) -> None:
        choice = root / LAB_CHOICE
        choice.parent.mkdir(parents=True, exist_ok=True)
        choice.write_text(change["new"] + "\n")
        status.value = (f"next run: <b>{Path(change['new']).stem}</b>: restart the kernel and run the "
                        "notebooks again (this one ran with " + Path(current).stem + ")")

    menu.observe(picked, names="value")
    box = widgets.HBox([menu, status])
    static = f"<p>profile: <b>{Path(current).stem}</b> ({current})</p>"
    display({"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                          "model_id": box.model_id},
             "text/html": static, "text/plain": f"profile: {Path(current).stem}"}, raw=True)
