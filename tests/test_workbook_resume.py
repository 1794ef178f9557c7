"""``eagle3lab run`` killed with SIGKILL inside 03 and again inside 04, then ``--resume``: nothing lost, nothing
duplicated, and the same figures as the unbroken smoke run of ``conftest.smoke_run`` (the same profile, seed 0,
on the same machine: every figure of the smoke profile is deterministic on the CPU).

The kill goes to the run's whole process group (the runner and the notebook kernel it started), as a job
scheduler's or an out-of-memory kill of the job does: a kernel left running would keep writing into the folder.
The moment is chosen by what is on disk: inside 03 once the first batch of samples is written, inside 04 once
the drafter's training checkpoint exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "tests" / "smoke.yaml"
STEPS = ["00_target", "01_diagnose", "02_patch", "03_engine", "04_train_drafter", "05_acceptance"]
# The figures an unbroken run and a killed-and-resumed one must share exactly (timings excepted).
SAME = ["target.heldout_ppl", "data.num_samples", "data.tokens", "data.response_tokens", "hidden.bytes",
        "train.steps", "train.final_loss", "train.acc_pos1", "train.acc_pos2", "train.acc_pos3",
        "acceptance.mean_acceptance_length", "acceptance.per_position_rate", "acceptance.outputs_match_greedy"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3lab", "run", *args, "--no-progress"]


def _kill_when(cmd: list[str], ready: Callable[[], bool], timeout: float = 900) -> None:
    """Start ``cmd`` in its own process group and SIGKILL the group as soon as ``ready()`` holds."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit {proc.returncode}) before the kill point:\n{proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the kill point never came")
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def _statuses(run_dir: Path) -> dict[str, str]:
    return {s["name"]: s["status"] for s in json.loads((run_dir / "metrics.json").read_text())["steps"]}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="01 and 02 diagnose and patch the installed vLLM; without one the workbook cannot run")
def test_run_killed_in_03_and_04_resumes_to_the_unbroken_runs_figures(smoke_run, tmp_path):
    outputs = tmp_path / "outputs"

    def run_dir() -> Path | None:
        found = sorted(p for p in outputs.glob("*-smoke") if p.is_dir()) if outputs.is_dir() else []
        return found[0] if found else None

    def in_03() -> bool:  # the first batch of samples is on disk: generation or extraction is under way
        d = run_dir()
        return d is not None and _lines(d / "artifacts" / "data" / "samples.jsonl") >= 8

    # 05's extras (layer probe, ablation, layer sweep, HumanEval) are the smoke run's to test; none of the figures
    # compared here comes from them, and they cost CI about a minute.
    cheap_05 = ["-p", "acceptance.probe=false", "-p", "acceptance.ablation=false", "-p", "acceptance.layer_sweep=[]",
                "-p", "acceptance.humaneval=false"]
    _kill_when(_cli("--params", str(SMOKE), *cheap_05, "--outputs", str(outputs)), in_03)
    d = run_dir()
    killed = _statuses(d)
    assert [killed[s] for s in STEPS[:3]] == ["ok"] * 3 and killed["03_engine"] == "pending", killed
    samples_at_kill = _lines(d / "artifacts" / "data" / "samples.jsonl")

    ckpt = d / "artifacts" / "drafter_ckpt" / "last.pt"
    _kill_when(_cli("--resume", str(d)), ckpt.is_file)
    killed = _statuses(d)
    assert killed["03_engine"] == "ok" and killed["04_train_drafter"] == "pending", killed
    step_at_kill = torch.load(ckpt, weights_only=False)["step"]

    r = subprocess.run(_cli("--resume", str(d)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((d / "metrics.json").read_text())
    assert [s["name"] for s in summary["steps"]] == STEPS and summary["ok"], summary["steps"]
    # each resumption reran what had not ended ok, once
    assert [x["rerun"] for x in summary["run"]["resumed"]] == [STEPS[3:], STEPS[4:]]

    # Nothing lost, nothing duplicated: every sample once, in order, byte for byte the unbroken run's; every
    # sample's aux states once; the training history one entry per step.
    ref_dir = smoke_run.run_dir
    samples = (d / "artifacts" / "data" / "samples.jsonl").read_bytes()
    assert samples == (ref_dir / "artifacts" / "data" / "samples.jsonl").read_bytes()
    assert [json.loads(x)["id"] for x in samples.splitlines()] == list(range(16))
    manifest = json.loads((d / "artifacts" / "hidden" / "manifest.json").read_text())
    ids = [i for shard in manifest["shards"] for i in shard["ids"]]
    assert sorted(ids) == list(range(16)) and len(ids) == 16 and manifest["complete"]
    m = {k: v for nb in summary["metrics"].values() for k, v in nb.items()}
    ref = {k: v for nb in json.loads((ref_dir / "metrics.json").read_text())["metrics"].values() for k, v in nb.items()}
    assert {k: m[k] for k in SAME} == {k: ref[k] for k in SAME}
    # the drafter itself, weight for weight
    mine = load_file(str(d / "artifacts" / "drafter" / "model.safetensors"))
    theirs = load_file(str(ref_dir / "artifacts" / "drafter" / "model.safetensors"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    print(f"killed in 03 with {samples_at_kill} sample lines on disk, in 04 at training step {step_at_kill}")
