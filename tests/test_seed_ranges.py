"""benchmarks/tools/seed_ranges.py: figures over seeds, and a new record checked against their range."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))  # the bench's tooling, not part of the installed package

import seed_ranges as SR  # noqa: E402


def record(seed: int | None, ppl: float, he: float, ng: float, wall: float = 600.0) -> dict:
    cmd = "-m eagle3lab run --params params/embedded.yaml --no-progress" + (f" -p seed={seed}" if seed is not None else "")
    return {"command": cmd, "wall_seconds": wall, "peak_rss_gb": 1.1, "machine": {"cpu": "x"}, "packages": {},
            "headline": {"target.heldout_ppl": ppl, "acceptance.humaneval_tau": he, "acceptance.humaneval_ngram_tau": ng,
                         "acceptance.ablation_best": "late [4, 5, 6]", "acceptance.ablation_resolved": False,
                         "acceptance.ablation_tied_with_best": ["early [1, 2, 3]"]}}


def test_make_gives_each_figures_spread_and_check_flags_a_run_outside_it(tmp_path):
    recs = [record(None, 130.0, 2.0, 1.5), record(1, 126.0, 2.2, 1.4), record(2, 128.0, 2.1, 1.6)]
    r = SR.make(recs, ["a", "b", "c"])
    assert r["seeds"] == [0, 1, 2]
    ppl = r["figures"]["target.heldout_ppl"]
    assert (ppl["min"], ppl["max"], ppl["values"]) == (126.0, 130.0, {"0": 130.0, "1": 126.0, "2": 128.0})
    assert ppl["mean"] == pytest.approx(128.0)
    margin = r["figures"]["humaneval_margin"]
    assert (margin["min"], margin["max"]) == (pytest.approx(0.5), pytest.approx(0.8))
    assert r["ablation"]["1"] == {"best": "late [4, 5, 6]", "resolved": False, "tied_with_best": ["early [1, 2, 3]"]}
    inside = {label: ok for label, _, _, _, ok in SR.check(record(3, 127.0, 2.05, 1.45), r)}
    assert all(inside.values()) and len(inside) == len(r["figures"])
    outside = {label: ok for label, _, _, _, ok in SR.check(record(3, 125.7, 2.05, 1.45), r)}
    assert outside == {**inside, "target held-out perplexity": False}
    slow = SR.make([record(None, 130.0, 2.0, 1.5, wall=3850.0), *recs[1:]], ["a", "b", "c"], untimed={0: "busy"})
    assert slow["figures"]["wall_seconds"]["values"] == {"1": 600.0, "2": 600.0}  # seed 0's timing left out
    assert slow["figures"]["target.heldout_ppl"]["values"]["0"] == 130.0 and slow["timing_left_out"] == {"0": "busy"}
    with pytest.raises(ValueError, match="two records of one seed"):
        SR.make([record(1, 1, 1, 1), record(1, 2, 2, 2)], ["a", "b"])


def test_the_command_line_exits_1_outside_the_range(tmp_path):
    files = []
    for i, rec in enumerate([record(None, 130.0, 2.0, 1.5), record(1, 126.0, 2.2, 1.4)]):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(rec))
    ranges = tmp_path / "ranges.json"
    tool = [sys.executable, str(ROOT / "benchmarks" / "tools" / "seed_ranges.py")]
    subprocess.run([*tool, "make", *map(str, files), "--out", str(ranges)], check=True, capture_output=True)
    new = tmp_path / "new.json"
    new.write_text(json.dumps(record(5, 140.0, 2.1, 1.45)))
    out = subprocess.run([*tool, "check", str(new), "--ranges", str(ranges)], capture_output=True, text=True)
    assert out.returncode == 1 and "OUTSIDE  target held-out perplexity: 140.000  (seeds: 126.000 .. 130.000)" in out.stdout
