"""``eagle3lab patch --check ARCH``: the interface of one architecture before and after the patch.

Runs in the calling process (the CLI starts a fresh one), so nothing leaks into a notebook kernel.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from eagle3lab import patch, vllm_compat


def check(arch: str, apply: bool = True, force: bool = False, legacy_simulation: bool = False) -> dict[str, Any]:
    """Interface of ``arch`` before and after (legacy simulation, then) the patch, in this process.

    ``ok`` is True when the class ends up supported whenever the patch was asked for. ValueError when
    ``arch`` cannot be loaded. vLLM's log lines go to stderr, so that ``--json`` output stays parseable.
    """
    with contextlib.redirect_stdout(sys.stderr):
        cls = vllm_compat.load_model_class(arch)
        out: dict[str, Any] = {"arch": arch, "vllm_version": vllm_compat.vllm_version(), "actions": []}
        if legacy_simulation:
            out["actions"] += [f"legacy simulation: {a}" for a in patch.simulate_legacy().actions]
        out["before"] = patch.interface_matrix([arch])[0]
        if apply:
            rep = patch.apply(force=force)
            out["actions"] += rep.actions
            out["noop"], out["reason"] = rep.noop, rep.reason
        else:
            out["noop"], out["reason"] = True, "patch.apply is false"
        out["after"] = patch.interface_matrix([arch])[0]
        out["refusal_before"] = out["before"]["refusal"]
        out["refusal_after"] = patch.refusal_for(cls)
        out["ok"] = bool(out["after"]["supports_eagle3"]) or not apply
    return out


def format_check(d: dict[str, Any]) -> str:
    """Human-readable form of :func:`check`'s result."""
    lines = [f"{d['arch']} on vLLM {d['vllm_version']}"]
    for when in ("before", "after"):
        r = d[when]
        lines.append(
            f"  {when:6s} supports_eagle3={r['supports_eagle3']!s:5s} nominal={r['nominal']!s:5s} "
            f"missing={r['members_missing'] or '-'}"
        )
        lines.append(f"         refusal: {r['refusal'] or 'none'}")
    if d.get("noop"):
        lines.append(f"  no-op: {d.get('reason', '')}")
    lines += [f"  - {a}" for a in d.get("actions", [])]
    lines.append("  OK" if d.get("ok") else "  FAILED: the class is still refused")
    return "\n".join(lines)
