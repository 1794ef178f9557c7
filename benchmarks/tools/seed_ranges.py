"""The default run's headline figures as ranges over seeds, and a new run checked against them.

    .venv/bin/python benchmarks/tools/seed_ranges.py make benchmarks/embedded-seed0-*.json ... --out FILE
    .venv/bin/python benchmarks/tools/seed_ranges.py check RECORD.json [--ranges FILE]

``make`` reads records of ``bench_embedded.py`` (one per seed, same profile and code) and writes, per figure, the
seeds' values, their mean, min and max. ``check`` says for each figure of a new record whether it lies inside the
range (exit 1 when one does not). Issue 35: the same code and seed give other figures on a CPU whose kernel paths
differ (DESIGN, "What is deterministic, and what is not"), so a run is compared with the spread that seeds give, not
with the last digit of one record. A range from a few seeds is narrow; a figure just outside it is worth a look,
not a verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# headline key -> (label, digits shown)
FIGURES: dict[str, tuple[str, int]] = {
    "target.heldout_ppl": ("target held-out perplexity", 1),
    "acceptance.mean_acceptance_length": ("τ at k=3, held-out prompts (reference decoder)", 2),
    "acceptance.ngram_tau": ("prompt lookup τ, held-out prompts", 2),
    "acceptance.eval_loop_fraction": ("loop fraction, held-out continuations", 2),
    "acceptance.humaneval_tau": ("HumanEval τ at k=3", 2),
    "acceptance.humaneval_ngram_tau": ("prompt lookup τ on HumanEval", 2),
    "acceptance.humaneval_loop_fraction": ("HumanEval loop fraction", 2),
    "humaneval_margin": ("HumanEval τ minus prompt lookup's", 2),
    "wall_seconds": ("wall time of the run (s)", 0),
    "peak_rss_gb": ("peak memory of the process tree (GB)", 2),
}


def figures(record: dict[str, Any]) -> dict[str, float]:
    """The figures of one bench_embedded record (those it has)."""
    h = record.get("headline", {})
    out = {k: float(h[k]) for k in FIGURES if k in h}
    for k in ("wall_seconds", "peak_rss_gb"):
        if k in record:
            out[k] = float(record[k])
    if "acceptance.humaneval_tau" in h and "acceptance.humaneval_ngram_tau" in h:
        out["humaneval_margin"] = float(h["acceptance.humaneval_tau"]) - float(h["acceptance.humaneval_ngram_tau"])
    return out


def seed_of(record: dict[str, Any]) -> int:
    """The seed a record ran with (``-p seed=N`` in its command; 0 by default)."""
    for part in record.get("command", "").split():
        if part.startswith("seed="):
            return int(part.split("=", 1)[1])
    return 0


TIMING = ("wall_seconds",)


def make(records: list[dict[str, Any]], names: list[str], untimed: dict[int, str] | None = None) -> dict[str, Any]:
    """Per figure: the values per seed, mean, min, max; the ablation's winner and resolution per seed.

    ``untimed``: seed -> why its wall time says nothing (it ran beside other work); its timing is left out of the
    timing figures' range, its other figures kept (they do not depend on the machine's load)."""
    untimed = untimed or {}
    seeds = [seed_of(r) for r in records]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"two records of one seed: {seeds}")
    per = [figures(r) for r in records]
    out: dict[str, Any] = {}
    for key, (label, _) in FIGURES.items():
        kept = [(s, p) for s, p in zip(seeds, per, strict=True) if not (key in TIMING and s in untimed)]
        pairs = [(s, p[key]) for s, p in kept if key in p]
        if pairs and len(pairs) == len(kept):  # a figure some kept record lacks gets no range
            vals = [v for _, v in pairs]
            out[key] = {"label": label, "values": {str(s): v for s, v in pairs},
                        "mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
    ablation = {str(s): {"best": r["headline"].get("acceptance.ablation_best"),
                         "resolved": r["headline"].get("acceptance.ablation_resolved"),
                         "tied_with_best": r["headline"].get("acceptance.ablation_tied_with_best")}
                for s, r in zip(seeds, records, strict=True)}
    machines = {json.dumps(r.get("machine", {}), sort_keys=True) for r in records}
    return {"what": "the default profile's headline figures over seeds (benchmarks/tools/seed_ranges.py)",
            "records": names, "seeds": seeds, "timing_left_out": {str(k): v for k, v in untimed.items()},
            "machine": [json.loads(m) for m in machines],
            "packages": records[0].get("packages", {}), "figures": out, "ablation": ablation}


def check(record: dict[str, Any], ranges: dict[str, Any]) -> list[tuple[str, float, float, float, bool]]:
    """(label, value, min, max, inside) per figure the ranges and the record share."""
    got = figures(record)
    rows = []
    for key, r in ranges["figures"].items():
        if key in got:
            rows.append((r["label"], got[key], r["min"], r["max"], r["min"] <= got[key] <= r["max"]))
    return rows


def latest_ranges(profile: str = "embedded") -> Path | None:
    """The newest ranges file of ``profile`` under benchmarks/ (None: none yet)."""
    found = sorted((ROOT / "benchmarks").glob(f"{profile}-ranges-*.json"))
    return found[-1] if found else None


def print_check(rows: list[tuple[str, float, float, float, bool]]) -> bool:
    """Print one line per figure; True when every figure lies inside its range."""
    for label, v, lo, hi, ok in rows:
        print(f"{'inside ' if ok else 'OUTSIDE'}  {label}: {v:.3f}  (seeds: {lo:.3f} .. {hi:.3f})")
    return all(r[4] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("records", nargs="+")
    mk.add_argument("--out", required=True)
    mk.add_argument("--untimed", action="append", default=[], metavar="SEED=WHY",
                    help="a seed whose wall time is left out of the range (it ran beside other work), and why")
    ck = sub.add_parser("check")
    ck.add_argument("record")
    ck.add_argument("--ranges", default=None)
    a = ap.parse_args()
    if a.cmd == "make":
        recs = [json.loads(Path(p).read_text()) for p in a.records]
        untimed = {int(u.split("=", 1)[0]): u.split("=", 1)[1] for u in a.untimed}
        Path(a.out).write_text(json.dumps(make(recs, [Path(p).name for p in a.records], untimed), indent=1) + "\n")
        print(f"-> {a.out}")
        return 0
    ranges_path = Path(a.ranges) if a.ranges else latest_ranges()
    if ranges_path is None:
        print("no ranges file under benchmarks/ (make one first)", file=sys.stderr)
        return 2
    print(f"against {ranges_path.name}")
    return 0 if print_check(check(json.loads(Path(a.record).read_text()), json.loads(ranges_path.read_text()))) else 1


if __name__ == "__main__":
    sys.exit(main())
