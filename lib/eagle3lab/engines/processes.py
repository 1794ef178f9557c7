"""Child processes that must not outlive us: process groups, their stopping, and the exit hooks that stop them.

A vLLM engine or server left behind holds the GPU for the next start. So every such child runs in a process group
of its own (``start_new_session``), is tracked here, and is stopped as a whole (SIGTERM, a grace period, SIGKILL)
on success, on exceptions, on Ctrl-C, at interpreter exit (atexit), on SIGTERM/SIGHUP to this process (a handler
installed when none is set), and, on Linux, when this process dies without running any of that
(``PR_SET_PDEATHSIG``). Used by the served engine's server (:mod:`eagle3lab.engines.vllm_served`) and the launch
probe's child (:mod:`eagle3lab.engines.launch_probe`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class Stoppable(Protocol):
    """Something the exit hooks stop: a server or a process group."""

    def stop(self) -> None:
        """Stop it and every process it started; idempotent."""
        ...


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``.

    Read from /proc so that zombies do not count: an orphan reparented to an init that never reaps
    (as in some containers) stays a zombie in the group forever, and ``killpg(pgid, 0)`` would say the
    group is alive. Without /proc, falls back to ``killpg(pgid, 0)`` (reports ``[pgid]`` when alive).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may contain spaces and parentheses): state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            members.append(int(d.name))
    return sorted(members)


_LIVE: set[Stoppable] = set()  # what the exit hooks stop
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def track(obj: Stoppable) -> None:
    """Have the exit hooks stop ``obj`` (installs them on first use: :func:`install_exit_hooks`)."""
    install_exit_hooks()
    with _LIVE_LOCK:
        _LIVE.add(obj)


def untrack(obj: Stoppable) -> None:
    """``obj`` is stopped: the exit hooks forget it."""
    with _LIVE_LOCK:
        _LIVE.discard(obj)


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for s in live:
        with contextlib.suppress(Exception):
            s.stop()


def _on_fatal_signal(signum: int, frame: Any) -> None:
    # SIGTERM/SIGHUP would end this interpreter without atexit: stop the servers, then die of the same
    # signal with its default action, so the exit status is what the sender expects.
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_exit_hooks() -> None:
    """Stop every tracked child at interpreter exit and on SIGTERM/SIGHUP to this process (once; where the main
    thread has set no handler of its own)."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_stop_all)
    # SIGINT needs nothing: Python raises KeyboardInterrupt, and context managers / atexit stop servers.
    # Handlers can only be set from the main thread, and a handler someone else set is left alone.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_fatal_signal)


# Runs first in the server's process: ask Linux to SIGTERM it when the thread that started it dies, then
# exec the real command. Catches the parent's SIGKILL (a notebook kernel killed hard), where no Python
# cleanup runs. The parent pid is checked after prctl, in case the parent died in between.
_PDEATHSIG_PRELUDE = (
    "import ctypes, os, signal, subprocess, sys, time\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
)
PDEATHSIG_EXEC = _PDEATHSIG_PRELUDE + "os.execvp(sys.argv[2], sys.argv[2:])\n"


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_process_group(proc: subprocess.Popen[Any], pgid: int, grace_s: float) -> list[int]:
    """SIGTERM process group ``pgid`` (led by ``proc``), wait up to ``grace_s``, then SIGKILL what is left.

    Returns the pids still alive after that (normally none).
    """
    deadline = time.monotonic() + grace_s
    _killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid) or proc.poll() is None:
        _killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        end = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.1)
    return group_members(pgid)


# Runs as the leader of a run_in_group job: ask Linux for SIGTERM when the thread that started it dies, start the
# job in the same group, and on SIGTERM (from there, or from stop_process_group) stop the whole group: a job's
# own helpers (an engine core) may ignore the death of their parent, so the guard does not leave it to them.
_GROUP_GUARD_EXEC = _PDEATHSIG_PRELUDE + (
    "grace = float(sys.argv[2])\n"
    "job = subprocess.Popen(sys.argv[3:])\n"
    "def stop(signum, frame):\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    os.killpg(0, signal.SIGTERM)\n"
    "    try: job.wait(timeout=grace)\n"
    "    except subprocess.TimeoutExpired: pass\n"
    "    time.sleep(0.5)\n"
    "    os.killpg(0, signal.SIGKILL)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    # not job.wait(): the handler's wait would then find Popen's wait lock taken and sleep out its whole grace
    "while job.poll() is None: time.sleep(0.05)\n"
    "rc = job.returncode\n"
    "sys.exit(rc if rc >= 0 else 128 - rc)\n"
)


class ProcessGroup:
    """A job started by :func:`start_in_group`: its own process group, stopped as a whole by :meth:`stop` (and
    by the same exit hooks as the servers, and by its guard when this process dies)."""

    def __init__(self, proc: subprocess.Popen[Any], grace_s: float) -> None:
        self.proc, self.grace_s = proc, grace_s

    def alive(self) -> bool:
        """Whether the job (its guard, which waits for it) is still running."""
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        """The job's exit status (128 + N when it died of signal N), or 124 when ``timeout_s`` passed first."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return 124

    def stop(self) -> None:
        """SIGTERM the whole group, SIGKILL what is left after the grace period."""
        stop_process_group(self.proc, self.proc.pid, self.grace_s)
        untrack(self)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_in_group(
    argv: Sequence[str],
    log_path: str | Path,
    *,
    env: Mapping[str, str] | None = None,
    grace_s: float = 15.0,
    die_with_parent: bool = True,
) -> ProcessGroup:
    """Start ``argv`` in a process group of its own, output to ``log_path`` (written afresh), and return it.

    The group is led by a guard process under ``PR_SET_PDEATHSIG``: if this process dies, even by SIGKILL, the
    guard stops the whole group, so a vLLM engine and its engine core cannot outlive the script that started
    them (they would hold the GPU and upset vLLM's memory profiling in the next engine's start; seen on
    2026-12-02, when a child in its own session outlived its parent's time limit).
    """
    install_exit_hooks()
    die_with_parent = die_with_parent and sys.platform.startswith("linux")
    full = ([sys.executable, "-c", _GROUP_GUARD_EXEC, str(os.getpid()), str(grace_s), *argv] if die_with_parent
            else list(argv))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None, start_new_session=True)
    group = ProcessGroup(proc, grace_s)
    track(group)
    return group


def run_in_group(
    argv: Sequence[str],
    log_path: str | Path,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    grace_s: float = 15.0,
    die_with_parent: bool = True,
) -> int:
    """Run ``argv`` to completion in a process group of its own (:func:`start_in_group`); returns its exit
    status (128 + N when the job died of signal N), or 124 when ``timeout_s`` passed.

    Whatever way this call ends (normal exit, timeout, an exception, Ctrl-C, SIGTERM/SIGHUP to this process,
    or this process killed outright), the whole group is stopped before it returns.
    """
    with start_in_group(argv, log_path, env=env, grace_s=grace_s, die_with_parent=die_with_parent) as group:
        return group.wait(timeout_s)


