"""benchmarks/tools/speed.py: the speed suite's figures from its engines' results, on hand-made results and on the results
committed from the H200 (read back and recomputed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))  # the bench's tooling, not part of the installed package
import speed as SPD  # noqa: E402

GPU = ROOT / "benchmarks/gpu/20261202-h200-proofs"


def result(tps: dict[str, float], stats: dict | None = None, outputs: list | None = None) -> dict:
    r = {"exit_code": 0, "bench": {b: {"tokens_per_s": v} for b, v in tps.items()}, "outputs": outputs or [[1, 2]]}
    if stats is not None:
        r["stats"] = stats
    return r


def test_instances_name_repeats_and_refuse_unknown_engines():
    assert SPD.instances(["native", "forced", "native", "forced"]) == [
        ("native", "speed-native"), ("forced", "speed-forced"), ("native", "speed-native-2"),
        ("forced", "speed-forced-2")]
    assert SPD.kind_of("speed-forced-2") == "forced" and SPD.kind_of("speed-baseline") == "baseline"
    with pytest.raises(ValueError, match="unknown engines"):
        SPD.instances(["native", "eagle"])


def test_medians_over_instances_and_their_spread():
    st = {"num_drafts": 10, "num_accepted_tokens": 15}
    R = {"speed-baseline": result({"1": 100.0}), "speed-native": result({"1": 200.0, "8": 800.0}, st),
         "speed-forced": result({"1": 190.0, "8": 900.0}, st), "speed-native-2": result({"1": 240.0}, st),
         "speed-forced-2": result({"1": 230.0}, dict(st, num_accepted_tokens=14))}
    f = SPD.figures(R, k=3)
    assert f["eagle3_tokens_per_s"] == {"1": 220.0, "8": 800.0}  # median of 200 and 240; batch 8 measured once
    assert f["forced_tokens_per_s"] == {"1": 210.0, "8": 900.0}
    assert f["forced_vs_native_throughput"]["1"] == pytest.approx(210 / 220)
    assert f["speedup"] == {"1": 2.2}
    assert f["instance_spread"] == {"native": {"1": 1.2}, "forced": {"1": pytest.approx(230 / 190)}}
    assert f["counters_equal_forced_native"] is False  # one forced instance accepted a token fewer
    assert f["tau_k3"] == 2.5
    # batch 1: target step 10 ms, an EAGLE-3 round 2.5 tokens at 220 tokens/s = 11.36 ms
    assert f["drafter_to_target_step_cost"] == pytest.approx((1e3 * 2.5 / 220 - 10) / 3 / 10)
    text = SPD.table({**f, "source_layers": 6, "layers": 96})
    assert "| 1 | 100 | 220 | 2.20x | 210 | 0.955 |" in text
    assert "2 native engines: fastest over slowest 1.200 at batch 1" in text


def test_engines_not_run_leave_cells_empty():
    f = SPD.figures({"speed-baseline": result({"1": 100.0}), "speed-native": {"exit_code": None, "not_run": True}}, 3)
    assert f["tau_k3"] is None and f["counters_equal_forced_native"] is None
    assert f["mismatching_prompts_baseline_native"] is None
    assert "| 1 | 100 | not run | not runx | not run | not run |" in SPD.table({**f, "source_layers": 6, "layers": 96})


def _kept(folder: Path) -> dict[str, dict]:
    return {p.name.removesuffix(".result.json"): json.loads(p.read_text()) for p in folder.glob("speed-*.result.json")}


def test_committed_h200_results_recompute_to_their_table():
    """The suite's table as the device wrote it (speed/speed.md) follows from the kept engine results."""
    R = _kept(GPU / "speed")
    f = SPD.figures(R, k=3)
    rows = [ln for ln in SPD.table({**f, "source_layers": 6, "layers": 96}).splitlines() if ln.startswith("|")]
    assert rows == [ln for ln in (GPU / "speed/speed.md").read_text().splitlines() if ln.startswith("|")]
    assert f["counters_equal_forced_native"] is True and f["stats_native"]["num_drafts"] == 942
    assert f["mismatching_prompts_baseline_native"] == 0 and f["mismatching_prompts_native_forced"] == 0


def test_committed_rerun_shows_the_instance_spread():
    """The native engine started again on a second machine (speed-rerun/): pooled with the first one, the spread
    between the two instances is what the README quotes (1.10, 1.03, 0.76 of itself -> max/min)."""
    R = _kept(GPU / "speed")
    again = json.loads((GPU / "speed-rerun/speed-native.result.json").read_text())
    assert again["outputs"] == R["speed-native"]["outputs"] and again["stats"] == R["speed-native"]["stats"]
    f = SPD.figures({**R, "speed-native-2": again}, k=3)
    ratio = {b: again["bench"][b]["tokens_per_s"] / R["speed-native"]["bench"][b]["tokens_per_s"] for b in ("1", "8", "32")}
    assert [round(ratio[b], 2) for b in ("1", "8", "32")] == [1.10, 1.03, 0.76]
    assert f["instance_spread"]["native"] == pytest.approx({b: max(r, 1 / r) for b, r in ratio.items()})


def test_identical_counters_compare_equal_even_where_a_rate_is_nan():
    """A position no draft reached has a NaN conditional rate; equal counters must still compare equal, and a
    difference in any raw counter must still show."""
    nan = float("nan")
    st = {"num_drafts": 14, "num_draft_tokens": 42, "num_accepted_tokens": 0, "accepted_per_pos": [0, 0, 0],
          "conditional_rate": [0.0, nan, nan]}
    R = {"speed-native": result({"1": 30.0}, dict(st)), "speed-forced": result({"1": 31.0}, dict(st))}
    assert SPD.figures(R, k=3)["counters_equal_forced_native"] is True
    R["speed-forced"]["stats"] = dict(st, accepted_per_pos=[1, 0, 0], num_accepted_tokens=1)
    assert SPD.figures(R, k=3)["counters_equal_forced_native"] is False
