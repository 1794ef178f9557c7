"""The diagnosis: why vLLM refuses EAGLE-3 for a target, a verdict, and the plan our patch follows."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.aux_ids import AuxIds, resolve_aux_ids
from eagle3lab.diagnose.levels import Level, level_chain
from eagle3lab.diagnose.plan import PatchPlan, plan_for
from eagle3lab.diagnose.protocol import eagle3_protocol_members
from eagle3lab.diagnose.sources import Gate, SourceSite, evaluate_gates, find_raise_sites
from eagle3lab.diagnose.target_info import TargetInfo, target_info

# Our patch (eagle3lab.patch) targets the DeepSeek-V2 text stack, which DeepSeek-V3, Kimi-K2/K2.5 and
# GLM-MoE-DSA reuse: these two class names are the anchor of that family.
FAMILY_CAUSAL_LM = "DeepseekV2ForCausalLM"
FAMILY_INNER_MODEL = "DeepseekV2Model"


@dataclass
class PlanStep:
    """One change our patch makes."""

    kind: str  # "add_interface" | "replace_forward" | "admit_model_type"
    target: str  # a class name, or file:line for a gate
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


@dataclass
class Diagnosis:
    """Everything :func:`diagnose` found; ``verdict`` is "native", "patchable" or "unsupported"."""

    target: str
    vllm_version: str
    info: TargetInfo
    resolved: bool
    levels: list[Level]
    protocol_members: list[str]
    raise_sites: list[SourceSite]
    gates: list[Gate]
    aux: AuxIds
    family: bool  # our patch applies (native or patchable by the plan); the name predates the general patch
    verdict: str
    reasons: list[str]
    plan: list[PlanStep]
    seconds: float = 0.0
    patch_plan: PatchPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (levels include their interface reports)."""
        return json.loads(json.dumps(asdict(self), default=str))

    # -- rows for tables (one dict per row, short values) ----------------------------------------------

    def level_rows(self) -> list[dict[str, Any]]:
        """The chain from the registered class to the model that runs the layers, one row per level."""
        return [
            {"level": lv.depth, "via": f".{lv.attribute}" if lv.attribute else "(registered)",
             "class": lv.class_name,
             "defined at": f"{lv.file.split('site-packages/')[-1]}:{lv.line}" if lv.file else lv.module,
             "supports_eagle3": lv.supports_eagle3, "runs the layers": lv.runs_layers,
             "forward collects aux": lv.forward_collects_aux}
            for lv in self.levels
        ]

    def member_rows(self) -> list[dict[str, Any]]:
        """Which members of the installed ``SupportsEagle3`` each level has ("yes" / "MISSING"): one row per
        member, one column per level (the members' long names fit a row; as columns they overflowed the page)."""
        return [
            {"member": m, **{lv.class_name: "yes" if m in lv.interface.members_present else "MISSING"
                             for lv in self.levels}}
            for m in self.protocol_members
        ]

    def raise_site_rows(self) -> list[dict[str, Any]]:
        """Where the installed vLLM raises the refusal."""
        return [{"file:line": f"{s.file}:{s.line}", "function": s.function, "full message": s.exact}
                for s in self.raise_sites]

    def gate_rows(self) -> list[dict[str, Any]]:
        """The front-end model_type gates and whether this target passes them."""
        return [{"gate": f"{g.file}:{g.line}", "allow-list": ", ".join(g.allowed),
                 "tests": f"{g.config_attr}.model_type", "target model_type": g.model_type, "passes": g.passes}
                for g in self.gates]

    def plan_rows(self) -> list[dict[str, Any]]:
        """The patch plan, one row per change."""
        return [{"step": i, "kind": s.kind, "target": s.target, "change": s.detail}
                for i, s in enumerate(self.plan, 1)]

    def metrics(self, key: str) -> dict[str, Any]:
        """Flat metrics for a run record, under ``diagnose.<key>.``."""
        out: dict[str, Any] = {f"diagnose.{key}.verdict": self.verdict}
        for lv in self.levels:
            out[f"diagnose.{key}.supports_eagle3.{lv.class_name}"] = lv.supports_eagle3
        return out


def diagnose(target: str | Path, drafter_config: str | Path | None = None) -> Diagnosis:
    """Diagnose EAGLE-3 support for ``target`` (architecture name, config.json or folder) on the installed vLLM.

    No GPU and no weights: the class is resolved through vLLM's registry and inspected.
    """
    t0 = time.perf_counter()
    info = target_info(target)
    vllm_compat.import_vllm()

    members = eagle3_protocol_members()
    raise_sites = find_raise_sites()
    gates = evaluate_gates(info)
    aux = resolve_aux_ids(info.num_hidden_layers, drafter_config)
    version = vllm_compat.vllm_version() or "unknown"

    def done(**kw: Any) -> Diagnosis:
        return Diagnosis(
            target=str(target), vllm_version=version, info=info, protocol_members=members,
            raise_sites=raise_sites, gates=gates, aux=aux, seconds=round(time.perf_counter() - t0, 2), **kw,
        )

    try:
        cls = vllm_compat.load_model_class(info.architecture)
    except ValueError as exc:  # not registered, or its module does not import on this host
        return done(resolved=False, levels=[], family=False, verdict="unsupported", plan=[],
                    reasons=[f"the class cannot be loaded here, so nothing can be patched: {exc}"])
    levels = level_chain(cls, info.text_architectures)
    plan = plan_for(cls, levels=levels)
    top, inner = levels[0], levels[-1]
    refusing = [g for g in gates if g.passes is False]
    unknown_gates = [g for g in gates if g.passes is None]
    reasons: list[str] = []
    if top.supports_eagle3:
        reasons.append(f"{top.class_name} satisfies SupportsEagle3 on vLLM {version}")
    else:
        reasons.append(
            f"{top.class_name} does not satisfy SupportsEagle3 on vLLM {version} "
            f"(missing: {', '.join(top.interface.members_missing) or 'none; structural check failed'})"
        )
    if inner.forward_collects_aux is False:
        reasons.append(f"{inner.class_name}.forward does not collect aux hidden states")
    for g in refusing:
        reasons.append(f"front-end gate {g.file}:{g.line} refuses model_type {g.model_type!r} (allowed: {g.allowed})")
    for g in unknown_gates:
        reasons.append(f"front-end gate {g.file}:{g.line} tests {g.config_attr}.model_type, unknown without a config.json")
    # The verdict is the patch plan's (the plan the patch executes), plus the front-end gate it also fixes.
    if plan.verdict == "native" and not refusing:
        verdict = "native"
    elif plan.verdict == "unsupported":
        verdict = "unsupported"
        reasons.append(f"our patch does not apply: {plan.reason}")
    else:
        verdict = "patchable"
        reasons.append(f"our patch: {plan.reason}")
    steps = _plan(plan, refusing + unknown_gates) if verdict == "patchable" else []
    if aux.problems:
        reasons.extend(f"aux ids: {p.message}" for p in aux.problems)
    return done(resolved=True, levels=levels, family=plan.verdict != "unsupported", verdict=verdict,
                reasons=reasons, plan=steps, patch_plan=plan)


def _plan(plan: PatchPlan, gates: list[Gate]) -> list[PlanStep]:
    """The plan's changes as rows: the interface per level, the forward, the front-end gate."""
    steps: list[PlanStep] = []
    for st in plan.interface:
        via = f" (base of {st.level_class})" if st.owner != st.level_class else ""
        what = "its inner model" if st.leaf else "the model it holds"
        steps.append(PlanStep(
            "add_interface", st.owner,
            f"add SupportsEagle3 to the bases of {st.owner}{via} and define "
            f"{', '.join(st.missing) or 'its members'}; the layer setters/getters delegate to self.{st.child} "
            f"({what})",
        ))
    if plan.forward == "deepseek":
        steps.append(PlanStep(
            "replace_forward", plan.forward_owner or "",
            f"replace {plan.forward_owner}.forward with the hand-written DeepSeek-V2 forward that returns "
            "(hidden_states, [aux...]), aux being hidden_states + residual at the input of each requested layer "
            "(id == num_layers: the final pre-norm state), and give it aux_hidden_state_layers = ()",
        ))
    elif plan.forward == "rewrite" and plan.loop is not None:
        lp = plan.loop
        res = f"{lp.hidden} + {lp.residual}" if lp.residual and lp.stream_adds_residual else lp.hidden
        res += f" (decoder layers: {lp.convention})" if lp.convention else ""
        steps.append(PlanStep(
            "rewrite_forward", plan.forward_owner or "",
            f"add aux collection to the installed {plan.forward_owner}.forward: in its loop `for ... in "
            f"{plan.loop.form}` collect {res} at the input of each requested layer (global id from "
            f"{plan.loop.start}; one past the last layer: the final pre-norm state) and return "
            "(hidden_states, [aux...]); give the inner model aux_hidden_state_layers = ()",
        ))
    for g in gates:
        mt = g.model_type or "<the target's text model_type>"
        steps.append(
            PlanStep(
                "admit_model_type",
                f"{g.file}:{g.line}",
                f"the allow-list {g.variable} (tested against {g.config_attr}.model_type) must admit {mt!r} "
                "in the front-end process too (SpeculativeConfig)",
            )
        )
    return steps


def format_diagnosis(d: Diagnosis) -> str:
    """Human-readable text of a :class:`Diagnosis` (what the CLI prints without --json)."""
    out = [f"EAGLE-3 diagnosis of {d.target} on vLLM {d.vllm_version}: {d.verdict.upper()}"]
    i = d.info
    out.append(
        f"  architecture {i.architecture}; model_type {i.model_type}; text model_type {i.text_model_type}; "
        f"layers {i.num_hidden_layers}"
    )
    out.append(f"  SupportsEagle3 members on this vLLM: {', '.join(d.protocol_members)}")
    if d.levels:
        out.append("  levels (registered class -> model that runs the layers):")
        for lv in d.levels:
            where = f"{lv.file}:{lv.line}" if lv.file else lv.module
            via = f" via .{lv.attribute} [{lv.how_found}]" if lv.attribute else ""
            out.append(f"    {'  ' * lv.depth}{lv.class_name}{via}  ({where})")
            out.append(
                f"    {'  ' * lv.depth}  supports_eagle3={lv.supports_eagle3}; missing: "
                f"{', '.join(lv.interface.members_missing) or '-'}; forward collects aux: {lv.forward_collects_aux}"
                f"; runs layers: {lv.runs_layers}"
            )
    out.append("  refusal raised at:")
    for s in d.raise_sites or []:
        out.append(f"    {s.file}:{s.line} in {s.function}(): {s.text}")
    if not d.raise_sites:
        out.append("    (not found in the installed vLLM)")
    for g in d.gates:
        state = {True: "passes", False: "REFUSES", None: "unknown"}[g.passes]
        out.append(
            f"  front-end gate {g.file}:{g.line} {g.variable}={g.allowed} on {g.config_attr}.model_type "
            f"{g.model_type!r}: {state}"
        )
    if not d.gates:
        out.append("  no model_type allow-list gate for eagle3 in this vLLM")
    a = d.aux
    out.append(f"  aux layer ids: {a.ids} ({a.source})")
    for p in a.problems:
        out.append(f"    ! {p.code}: {p.message}")
    out.append("  why:")
    out.extend(f"    - {r}" for r in d.reasons)
    if d.plan:
        out.append("  patch plan:")
        out.extend(f"    {n}. [{s.kind}] {s.target}: {s.detail}" for n, s in enumerate(d.plan, 1))
    return "\n".join(out)

