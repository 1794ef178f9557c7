"""The batch runner: execute the workbook's notebooks in order with papermill, one immutable run folder.

``outputs/<timestamp>-<profile>/`` receives each executed notebook and its HTML export (with one shared
``plotly.min.js``), the resolved ``params.yaml``, ``metrics.json`` (what the notebooks recorded through
``Workbook.record``), ``run.log`` (one line per step and per real warning; vLLM's own log is in
``logs/vllm.log``) and ``index.html`` (the overview, see :mod:`eagle3lab.overview`). A failing notebook still gets its executed copy and HTML (the failing
cell visible); later notebooks are skipped and the run reports failure.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from eagle3lab import overview, provenance, report
from eagle3lab import params as params_mod
from eagle3lab.progress import BATCH_ENV
from eagle3lab.workbook import read_metrics, repo_root

log = logging.getLogger("eagle3lab.runner")

@dataclass
class StepResult:
    """What happened to one notebook in a run."""

    name: str
    status: str = "pending"  # ok | failed | skipped
    seconds: float = 0.0
    error: str = ""
    ipynb: str = ""
    html: str = ""


@dataclass
class RunResult:
    """The outcome of ``run``: the folder and the status of every step."""

    run_dir: Path
    steps: list[StepResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.status == "ok" for s in self.steps)

    @property
    def failed(self) -> bool:
        """A step failed (or was skipped after one); ``pending`` steps of a run stopped by ``until`` are not."""
        return any(s.status in ("failed", "skipped") for s in self.steps)


def discover_notebooks(root: Path) -> list[Path]:
    """The workbook's notebooks (``notebooks/NN_name.ipynb``) in order."""
    return sorted(p for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def select_notebooks(available: list[Path], only: list[str] | None) -> list[Path]:
    """Pick notebooks by number or stem (``01``, ``01_diagnose``); unknown names are an error."""
    if not only:
        return available
    chosen = []
    for name in only:
        match = [p for p in available if p.stem == name or p.stem.split("_", 1)[0] == name]
        if not match:
            names = ", ".join(p.stem for p in available)
            raise params_mod.ParamsError("--only", name, f"no such notebook (have: {names})")
        chosen.extend(m for m in match if m not in chosen)
    return sorted(chosen)


def new_run_dir(outputs: Path, profile: str) -> Path:
    """A fresh folder ``<timestamp>-<profile>``; never reuses an existing one."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    outputs.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        d = outputs / (f"{stamp}-{profile}" + (f"-{n + 1}" if n else ""))
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot make a new run folder under {outputs}")


def _kernel_env(tmp: Path) -> str:
    """Register a kernel spec for *this* interpreter, so notebooks run in the current environment."""
    name = "eagle3lab-current"
    kdir = tmp / "kernels" / name
    kdir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--IPKernelApp.log_level=ERROR"],
        "display_name": f"eagle3lab ({sys.executable})",
        "language": "python",
    }
    (kdir / "kernel.json").write_text(json.dumps(spec))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(tmp), os.environ.get("JUPYTER_PATH")]))
    return name


def _short_error(exc: BaseException) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    cell = getattr(exc, "exec_count", None)
    where = f" (cell [{cell}])" if cell else ""
    return f"{ename}: {evalue}{where}".strip()


# What a batch kernel needs in its environment: every progress bar off (ours through EAGLE3LAB_BATCH; tqdm's
# default for bars that do not pass ``disable``; huggingface's), so no refresh reaches a page or run.log.
BATCH_KERNEL_ENV = {BATCH_ENV: "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def cell_warnings(notebook_path: Path) -> list[str]:
    """The real warnings of an executed notebook: its cells' stderr text without progress-bar noise,
    one line each (``cell [n]: text``), in order, without repeats."""
    import nbformat

    nb = nbformat.read(str(notebook_path), as_version=4)
    seen: list[str] = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = " | ".join(report.drop_progress_noise(out.text).split("\n")).strip(" |")
                line = f"cell [{cell.get('execution_count')}]: {text[:300]}"
                if text and line not in seen:
                    seen.append(line)
    return seen


def _vllm_log_summary(run_dir: Path) -> str | None:
    path = run_dir / "logs" / "vllm.log"
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    serious = sum(1 for ln in lines if " WARNING " in ln or " ERROR " in ln)
    return f"vLLM log: logs/vllm.log ({len(lines)} lines, {serious} WARNING/ERROR)"


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then one rename. ``metrics.json`` is what
    ``--resume`` reads back, so a run killed while rewriting it must leave the previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_summary(summary_file: Path) -> dict[str, Any]:
    """A run's ``metrics.json``; a file that is not JSON (or not a run's summary) is a ParamsError naming it."""
    try:
        summary = json.loads(summary_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise params_mod.ParamsError(str(summary_file), "metrics.json", f"not valid JSON ({exc}): the run's record "
                                     "is corrupt, so it cannot be resumed") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("steps"), list):
        raise params_mod.ParamsError(str(summary_file), "steps", "not a run's summary (no list of steps)")
    return summary


def _write_summary(result: RunResult, p: params_mod.Params, info: dict[str, Any]) -> None:
    metrics = read_metrics(result.run_dir)
    summary = {
        "run": info,
        "ok": result.ok,
        "steps": [asdict(s) for s in result.steps],
        "metrics": metrics,
    }
    _write_text_atomic(result.run_dir / "metrics.json", json.dumps(summary, indent=2, sort_keys=False))
    title = f"eagle3lab run {result.run_dir.name}"
    files = [f for f in ("metrics.json", "run.log", "params.yaml", "logs/vllm.log") if (result.run_dir / f).is_file()]
    page = overview.index_html(title, [asdict(s) for s in result.steps], metrics, info, files)
    if overview.FIGURE_MARK in page:
        report.write_plotly_js(result.run_dir)
    (result.run_dir / "index.html").write_text(page, encoding="utf-8")


def run(
    params_file: str | Path | None = None,
    only: list[str] | None = None,
    overrides: list[str] | None = None,
    outputs: str | Path | None = None,
    progress: bool = True,
    until: str | None = None,
) -> RunResult:
    """Validate the params, then execute the selected notebooks into a new run folder.

    ``until`` (a notebook's number or name) stops the run after that step: the later steps stay ``pending``
    for :func:`resume` (a long run split over several sessions). Raises :class:`eagle3lab.params.ParamsError` before anything is written when the params or the
    selection are bad.
    """
    root = repo_root()
    pfile = Path(params_file) if params_file else root / "params" / "embedded.yaml"
    p = params_mod.load(pfile, overrides)
    available = discover_notebooks(root)
    steps = select_notebooks(available, only or p.notebooks)
    if not steps:
        raise params_mod.ParamsError(str(pfile), "notebooks", f"no notebooks found under {root / 'notebooks'}")
    stop_after = select_notebooks(steps, [until])[0].stem if until else None

    run_dir = new_run_dir(Path(outputs) if outputs else root / "outputs", p.profile)
    injected = params_mod.to_jsonable(p)
    (run_dir / "params.yaml").write_text(yaml.safe_dump(injected, sort_keys=False))
    info = {
        "run": run_dir.name,
        "profile": p.profile,
        "description": p.description,  # the profile's own reason for its sizes, on the index page
        "params_file": str(pfile),
        "overrides": list(overrides or []),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.executable,
        "packages": provenance.package_versions(),
    }
    # A reader of the index must see that a step is absent by choice, not lost: the run records what it left out.
    left_out = [nb.stem for nb in available if nb not in steps]
    if left_out:
        info["left_out"] = left_out
    result = RunResult(run_dir, [StepResult(nb.stem) for nb in steps])
    return _execute(root, p, injected, steps, result, info, progress, stop_after)


def resume(run_dir: str | Path, progress: bool = True, until: str | None = None) -> RunResult:
    """Continue a run folder whose run stopped (a failed step, a killed process, a time limit).

    The folder's own ``params.yaml`` is the run's parameters (a resumed run cannot change them); the steps
    that ended ``ok`` in its ``metrics.json`` are kept as they are, and every other step is executed again,
    in order, into the same folder (up to ``until``, as in :func:`run`). The notebooks' artifacts are
    resumable, so work that finished before the stop (a trained target, generated samples) is not redone.
    ``info["resumed"]`` records when and where.
    """
    root = repo_root()
    run_dir = Path(run_dir)
    summary_file, pfile = run_dir / "metrics.json", run_dir / "params.yaml"
    for f in (summary_file, pfile):
        if not f.is_file():
            raise params_mod.ParamsError(str(run_dir), f.name, "not a run folder (no such file): nothing to resume")
    summary = read_summary(summary_file)
    p = params_mod.load(pfile)
    injected = params_mod.to_jsonable(p)
    by_name = {nb.stem: nb for nb in discover_notebooks(root)}
    previous = [StepResult(**s) for s in summary.get("steps", [])]
    missing = [s.name for s in previous if s.name not in by_name]
    if missing:
        raise params_mod.ParamsError(str(summary_file), "steps", f"notebooks no longer in the workbook: {missing}")
    info = dict(summary.get("run", {}))
    info.pop("finished", None)
    info["resumed"] = [*info.get("resumed", []), {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "rerun": [s.name for s in previous if s.status != "ok"], "packages": provenance.package_versions()}]
    for s in previous:
        if s.status != "ok":
            s.status, s.error, s.seconds = "pending", "", 0.0
    result = RunResult(run_dir, previous)
    notebooks = [by_name[s.name] for s in previous]
    stop_after = select_notebooks(notebooks, [until])[0].stem if until else None
    return _execute(root, p, injected, notebooks, result, info, progress, stop_after)


def _execute(
    root: Path,
    p: params_mod.Params,
    injected: dict[str, Any],
    steps: list[Path],
    result: RunResult,
    info: dict[str, Any],
    progress: bool,
    stop_after: str | None = None,
) -> RunResult:
    """Execute every step of ``result`` that is not already ``ok``, writing the run folder as it goes; after
    the step named ``stop_after`` the rest stay ``pending``."""
    import papermill as pm
    from tqdm.auto import tqdm

    run_dir = result.run_dir
    handler = logging.FileHandler(run_dir / "run.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    # Our own lines at INFO; papermill's only when something goes wrong (its INFO lines repeat ours).
    watched = {logging.getLogger("eagle3lab"): logging.INFO, logging.getLogger("papermill"): logging.WARNING}
    old_levels = {lg: lg.level for lg in watched}
    for lg, level in watched.items():
        lg.addHandler(handler)
        lg.setLevel(level)
    todo = [s.name for s in result.steps if s.status != "ok"]
    log.info("run %s: profile %s, notebooks %s%s", run_dir, p.profile, ", ".join(todo),
             " (resumed)" if info.get("resumed") else "")
    _write_summary(result, p, info)  # a run killed in its first step can still be resumed
    stopped = False
    old_env = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(prefix="eagle3lab-kernel-") as tmp:
            kernel = _kernel_env(Path(tmp))
            os.environ["EAGLE3LAB_ROOT"] = str(root)
            os.environ.update(BATCH_KERNEL_ENV)
            failed = False
            bar = tqdm(list(zip(steps, result.steps, strict=True)), desc="workbook", unit="notebook", disable=not progress)
            for nb, step in bar:
                if step.status == "ok" or stopped:
                    continue
                if failed:
                    step.status = "skipped"
                    log.info("%s: skipped (an earlier step failed)", step.name)
                    continue
                bar.set_postfix_str(step.name)
                out_nb = run_dir / f"{step.name}.ipynb"
                step.ipynb = out_nb.name
                t0 = time.time()
                try:
                    pm.execute_notebook(
                        str(nb),
                        str(out_nb),
                        parameters={"params": injected, "run_dir": str(run_dir)},
                        kernel_name=kernel,
                        cwd=str(root),
                        log_output=False,  # cell output is in the notebook; run.log gets warnings below
                        progress_bar=progress,
                    )
                    step.status = "ok"
                except BaseException as exc:  # noqa: BLE001 - any failure ends the run, reported
                    step.status = "failed"
                    step.error = "interrupted" if isinstance(exc, KeyboardInterrupt) else _short_error(exc)
                    failed = True
                    log.error("%s: failed: %s", step.name, step.error)
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                finally:
                    step.seconds = time.time() - t0
                    if out_nb.exists():
                        for w in cell_warnings(out_nb):
                            log.warning("%s: %s", step.name, w)
                        try:
                            report.export_html(out_nb, run_dir / f"{step.name}.html")
                            step.html = f"{step.name}.html"
                        except Exception as exc:  # noqa: BLE001 - a report problem must not hide the result
                            log.error("%s: HTML export failed: %s", step.name, exc)
                    _write_summary(result, p, info)
                log.info("%s: %s in %.1f s", step.name, step.status, step.seconds)
                if step.name == stop_after:
                    stopped = True
                    log.info("stopped after %s (--until): resume with eagle3lab run --resume %s", step.name, run_dir)
    finally:
        summary = _vllm_log_summary(run_dir)
        if summary:
            log.info(summary)
        for s in result.steps:
            if s.status == "pending" and not stopped:
                s.status = "skipped"
        info["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        _write_summary(result, p, info)
        os.environ.clear()
        os.environ.update(old_env)
        for lg, level in old_levels.items():
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()
    return result
