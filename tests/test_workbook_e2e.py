"""The real workbook, 00 through 05, end to end on the smoke profile, read back from its record."""

import json
from pathlib import Path

import pytest

from eagle3lab import report, runner

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("vllm")


@pytest.mark.slow
def test_smoke_workbook_end_to_end(tmp_path):
    res = runner.run(ROOT / "tests" / "smoke.yaml", outputs=tmp_path, progress=False)
    summary = json.loads((res.run_dir / "metrics.json").read_text())
    failed = [(s["name"], s["error"]) for s in summary["steps"] if s["status"] != "ok"]
    assert not failed, failed
    assert [s["name"] for s in summary["steps"]] == [
        "00_target", "01_diagnose", "02_patch", "03_engine", "04_train_drafter", "05_acceptance"]
    m = {k: v for nb in summary["metrics"].values() for k, v in nb.items()}

    # 01/02: the legacy simulation reproduces the refusal; the patch lifts it for the wrapper that vLLM checks.
    assert m["patch.before.KimiK25ForConditionalGeneration.supports_eagle3"] is False
    assert m["patch.after.KimiK25ForConditionalGeneration.supports_eagle3"] is True
    # 00: a trained target; 03: data and aux states at the configured ids; 05: a real measurement.
    assert m["target.heldout_ppl"] > 1.0
    assert m["hidden.aux_layer_ids"] == [1, 2, 4]
    assert m["hidden.verify_max_abs_diff"] < 1e-4
    assert m["acceptance.outputs_match_greedy"] is True
    assert 1.0 <= m["acceptance.mean_acceptance_length"] <= 4.0
    assert len(m["acceptance.per_position_rate"]) == 3
    # the per-layer comparison: the 04 drafter and one more choice of target layers
    assert list(m["acceptance.layer_sweep"]) == ["[1, 2, 4] (04)", "[2, 3, 4]"]
    assert all(s["num_drafts"] > 0 for s in m["acceptance.layer_sweep"].values())

    for step in summary["steps"]:
        html = (res.run_dir / step["html"]).read_text()
        assert report.external_scripts(html) == [], step["name"]
    index = (res.run_dir / "index.html").read_text()
    assert "05_acceptance.html" in index and "acceptance.mean_acceptance_length" in index
