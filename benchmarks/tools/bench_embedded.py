"""Benchmark the README's run command: wall time and peak memory of the whole process tree.

    .venv/bin/python benchmarks/tools/bench_embedded.py [--params params/embedded.yaml] [-p k=v ...] [--check]

Runs `python -m eagle3lab run` as a child, samples the summed RSS of it and all its descendants (the
notebook kernels) every 0.5 s, and writes benchmarks/<profile>-<date>.json with the machine, the date,
the figures and the run's headline metrics. Targets (issue 3): <= 15 min and < 8 GB on 2 cores / 24 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

from eagle3lab.provenance import package_versions

ROOT = Path(__file__).resolve().parents[2]


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_kernels() -> dict[str, str | bool]:
    """What decides the CPU's float32 kernel paths: torch's ATen capability (DEFAULT / AVX2 / AVX512) and whether
    the CPU has AVX-512 at all. The same code and seed train a different target on machines whose paths differ
    (issue 35), so a record must say which it ran on."""
    import torch

    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "avx512f": " avx512f" in flags,
            "amx": " amx_tile" in flags}


def record(summary: dict, run_dir: Path | None, command: str, wall: float | None, peak: int | None,
           exit_code: int) -> dict:
    """The benchmark record of a run (its metrics.json as ``summary``); wall time and memory only when measured."""
    merged = {k: v for m in summary.get("metrics", {}).values() for k, v in m.items()}
    timing = {} if wall is None else {"wall_seconds": round(wall, 1), "peak_rss_gb": round((peak or 0) / 2**30, 2)}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "mem_gb": round(psutil.virtual_memory().total / 2**30, 1),
                    "python": platform.python_version(), **cpu_kernels()},
        "packages": package_versions(),
        "command": command,
        "exit_code": exit_code,
        **timing,
        "steps": summary.get("steps", []),
        "run_dir": str(run_dir) if run_dir else None,
        "headline": {k: merged[k] for k in sorted(merged) if k.startswith(("acceptance.", "target.", "train.", "hidden.", "data.",
                                                                        "patch.engine.", "patch.legacy_simulation"))},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default=str(ROOT / "params" / "embedded.yaml"))
    ap.add_argument("-p", dest="overrides", action="append", default=[])
    ap.add_argument("--check", action="store_true",
                    help="compare the figures with the newest benchmarks/<profile>-ranges-*.json (exit 1 outside)")
    ap.add_argument("--from-run", type=Path, default=None, metavar="RUN",
                    help="record an existing run folder instead of running (no wall time or memory: say why with "
                         "seed_ranges.py make --untimed); its seed is the folder's params.yaml's")
    a = ap.parse_args()
    if a.from_run is not None:
        import yaml

        seed = yaml.safe_load((a.from_run / "params.yaml").read_text()).get("seed", 0)
        a.overrides = [o for o in a.overrides if not o.startswith("seed=")] + [f"seed={seed}"]
        summary = json.loads((a.from_run / "metrics.json").read_text())
        how = f"recorded from the run folder {a.from_run} (resumed: {summary.get('run', {}).get('resumed', 'no')})"
        ok = bool(summary.get("steps")) and all(st["status"] == "ok" for st in summary["steps"])
        result = record(summary, a.from_run, f"{how}; seed={seed}", None, None, 0 if ok else 1)
    else:
        cmd = [sys.executable, "-m", "eagle3lab", "run", "--params", a.params, "--no-progress"]
        for o in a.overrides:
            cmd += ["-p", o]
        t0 = time.time()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        proc = psutil.Process(child.pid)
        peak = 0
        while child.poll() is None:
            peak = max(peak, tree_rss(proc))
            time.sleep(0.5)
        wall = time.time() - t0
        out = child.stdout.read() if child.stdout else ""
        print(out, end="")
        report_line = [ln for ln in out.splitlines() if ln.startswith("report: ")]
        run_dir = Path(report_line[-1].split("report: ", 1)[1]).parent if report_line else None
        summary = json.loads((run_dir / "metrics.json").read_text()) if run_dir else {}
        result = record(summary, run_dir, " ".join(cmd[1:]), wall, peak, child.returncode)
    profile = Path(a.params).stem
    seed = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("seed=")), None)
    tag = f"{profile}-seed{seed}" if seed is not None else profile
    dest = ROOT / "benchmarks" / f"{tag}-{datetime.now().strftime('%Y%m%d-%H%M')}.json"
    dest.write_text(json.dumps(result, indent=2))
    print(f"wall {result.get('wall_seconds')} s, peak RSS {result.get('peak_rss_gb')} GB -> {dest}")
    if a.check and result["exit_code"] == 0:
        sys.path.insert(0, str(Path(__file__).parent))
        import seed_ranges

        ranges = seed_ranges.latest_ranges(profile)
        if ranges is None:
            print(f"no benchmarks/{profile}-ranges-*.json to check against")
            return 2
        print(f"against {ranges.name}")
        return 0 if seed_ranges.print_check(seed_ranges.check(result, json.loads(ranges.read_text()))) else 1
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
