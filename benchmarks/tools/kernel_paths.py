"""Why the default CPU run's figures move between machines (issue 35): the same code, seed and data, trained under
different CPU kernel paths on one machine.

Each configuration runs in a fresh process (the paths are chosen at import): ATen's vectorised kernels
(``ATEN_CPU_CAPABILITY``: the CPU's own, or ``default``, the unvectorised ones) and MKL's GEMM dispatch
(``MKL_CBWR``: AUTO, the CPU's best path, or a fixed older instruction set). A machine with AVX-512 takes other
paths than one with AVX2 only, as these settings do here. Every configuration runs twice: equal loss curves within
a configuration say the run is deterministic on one path; different curves across configurations say the path
alone changes the trained target.

    .venv/bin/python benchmarks/tools/kernel_paths.py [--steps 60] [--out benchmarks/kernel-paths-<host>-<date>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "as installed": {},
    "ATen default kernels": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL SSE4.2 path": {"MKL_CBWR": "SSE4_2"},
    "MKL compatible path": {"MKL_CBWR": "COMPATIBLE"},
    "one thread": {"OMP_NUM_THREADS": "1"},
}

_CHILD = """
import json, sys
import torch
from eagle3lab import params as P, target as T
p = P.load(sys.argv[1])
spec = p.target.embedded
corpus = T.build_corpus(300_000, spec.heldout_fraction)
tok = T.train_tokenizer(corpus, spec.vocab_size)
cfg = T.make_config(spec, tok)
res = T.train_target(cfg, tok, corpus, int(sys.argv[2]), spec.batch_size, spec.seq_len, spec.learning_rate, 0,
                     progress=False)
print("RESULT", json.dumps({"losses": [float(x) for x in res.losses], "capability": torch.backends.cpu.get_cpu_capability(),
                            "threads": torch.get_num_threads()}))
"""


def run(env_extra: dict[str, str], steps: int) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "params" / "embedded.yaml"), str(steps)],
                         env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_embedded import cpu_kernels, cpu_model

    rows = {}
    for name, extra in CONFIGS.items():
        runs = [run(extra, a.steps) for _ in range(2)]
        rows[name] = {"env": extra, "capability": runs[0]["capability"], "losses": runs[0]["losses"],
                      "repeat_identical": runs[0]["losses"] == runs[1]["losses"]}
        print(name, rows[name]["capability"], "final loss", runs[0]["losses"][-1], "repeat identical",
              rows[name]["repeat_identical"], flush=True)
    ref = rows["as installed"]["losses"]
    for r in rows.values():
        diffs = [abs(x - y) for x, y in zip(r["losses"], ref, strict=True)]
        r["first_step_differing"] = next((i for i, d in enumerate(diffs) if d > 0), None)
        r["max_abs_loss_diff"] = max(diffs)
        r["final_loss"] = r["losses"][-1]
    result = {"what": "the default profile's target trained for --steps steps (300 kB corpus, seed 0) under several "
                      "CPU kernel paths, each twice, in fresh processes",
              "date": time.strftime("%Y-%m-%d"), "steps": a.steps,
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          **cpu_kernels()},
              "configs": rows}
    out = a.out or ROOT / "benchmarks" / f"kernel-paths-{platform.node() or 'cpu'}-{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:24s} first differing step {r['first_step_differing']}, max |loss diff| "
              f"{r['max_abs_loss_diff']:.3g}, final {r['final_loss']:.4f}, repeat identical {r['repeat_identical']}")
    print("->", out)


if __name__ == "__main__":
    main()
