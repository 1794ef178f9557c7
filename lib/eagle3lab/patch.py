"""Give vLLM 0.15-0.17's DeepSeek-V2/V3 and Kimi-K2.5 classes the EAGLE-3 interface, in-process.

vLLM refuses an EAGLE-3 drafter unless the *top-level* model class (the one the model runner holds,
``KimiK25ForConditionalGeneration`` for Kimi-K2.5, not the inner text model) is a ``SupportsEagle3``;
0.17 also refuses ``method="eagle3"`` in ``SpeculativeConfig`` for model types outside an allow-list.
This module fixes both without editing any installed file:

- the top-level classes get ``SupportsEagle3`` as a nominal base and every member the *installed*
  Protocol lists (the Kimi wrapper delegates to its language model);
- ``DeepseekV2Model.forward`` is replaced by the installed version's forward plus aux hidden-state
  collection, the way vLLM 0.26 does it natively (:func:`run_layers_collecting_aux`);
- 0.17's front-end allow-list (located by :func:`eagle3lab.vllm_compat.frontend_gates`) gets the
  DeepSeek / Kimi model types.

Every change is recorded in ``_REGISTRY`` (the only global state of the project), so applying twice
equals applying once and :func:`revert` restores the exact originals. On vLLM >= 0.18 (native support)
:func:`apply` is a reported no-op unless ``force=True``; :func:`simulate_legacy` removes the native
support in-process to reproduce the 0.15-0.17 refusal.

vLLM starts separate processes (engine core, one worker per tensor-parallel rank); the patch reaches them
through the general plugin in :mod:`eagle3lab.plugin`. ``eagle3lab patch --check`` is
:mod:`eagle3lab.patch_check`. vLLM is imported lazily (through :mod:`eagle3lab.vllm_compat`): every vLLM
process imports this module.
"""

from __future__ import annotations
import __future__

import functools
import hashlib
import inspect
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3lab import layer_loop, vllm_compat
from eagle3lab.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3lab.diagnose.levels import level_chain
from eagle3lab.diagnose.plan import InterfaceStep, PatchPlan, plan_for
from eagle3lab.diagnose.protocol import eagle3_protocol_members, interface_report

# What the matrices show: the family's causal LM, its DeepSeek-V3 subclass, and the Kimi-K2.5 wrapper.
ARCHES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
# Model types 0.17's SpeculativeConfig must admit for method eagle3 (substring match, like vLLM's own).
GATE_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2", "kimi_k25")

_DEEPSEEK_MODULE = "vllm.model_executor.models.deepseek_v2"
_KIMI_MODULE = "vllm.model_executor.models.kimi_k25"
# Names that belong to EAGLE-3 alone in any release (older getter name included): what the legacy
# simulation strips. SupportsEagleBase's members (has_own_lm_head, ...) are shared with EAGLE-1/2: kept.
_EAGLE3_ONLY = (
    "supports_eagle3",
    "set_aux_hidden_state_layers",
    "get_eagle3_aux_hidden_state_layers",
    "get_eagle3_default_aux_hidden_state_layers",
)
_GETTERS = ("get_eagle3_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers")

PATCH = "patch"
LEGACY = "legacy_simulation"


class _Missing:
    """Marks an attribute that was absent from a class's own ``__dict__``."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


@dataclass
class PatchRecord:
    """One in-process change: ``target.attribute`` went from ``original`` to ``replacement``."""

    target: Any
    attribute: str
    original: Any
    replacement: Any

    def describe(self) -> str:
        """One line for reports, e.g. ``set DeepseekV2Model.forward``."""
        name = getattr(self.target, "__qualname__", getattr(self.target, "__name__", repr(self.target)))
        if self.attribute == "__code__":
            return f"replace the code of {name} (allow-list constant extended)"
        if self.attribute == "__bases__":
            old = ", ".join(b.__name__ for b in self.original)
            new = ", ".join(b.__name__ for b in self.replacement)
            return f"{name}.__bases__: ({old}) -> ({new})"
        verb = "delete" if self.replacement is MISSING else ("add" if self.original is MISSING else "replace")
        return f"{verb} {name}.{self.attribute}"


# group (PATCH or LEGACY) -> changes in the order they were made. Insertion order of the groups is the
# order they were applied, so revert() walks both lists backwards.
_REGISTRY: dict[str, list[PatchRecord]] = {}


@dataclass
class PatchReport:
    """What :func:`apply` or :func:`simulate_legacy` did, with the interface matrix around it."""

    vllm_version: str
    operation: str
    actions: list[str] = field(default_factory=list)
    noop: bool = False
    reason: str = ""
    native_support: bool = False
    legacy_simulation: bool = False
    forced: bool = False
    gate: dict[str, Any] = field(default_factory=dict)
    before: list[dict[str, Any]] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Aux hidden-state collection (pure: no vLLM)
# --------------------------------------------------------------------------------------------------


def run_layers_collecting_aux(
    layers: Sequence[Any],
    hidden_states: Any,
    residual: Any,
    aux_ids: Iterable[int],
    call: Callable[[Any, Any, Any], tuple[Any, Any]],
    start_layer: int = 0,
    prepare: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None,
    finish_aux: Callable[[Any], Any] | None = None,
    collect_final: bool = True,
) -> tuple[Any, Any, list[Any]]:
    """Run ``layers`` (global ids ``start_layer, start_layer+1, ...``) and collect aux hidden states.

    For each requested id k inside this range, ``hidden_states + residual`` at the *input* of layer k
    (the residual stream after layer k-1) is collected; with ``collect_final`` an id equal to the end
    of the range gives the final pre-norm state. States come back in ascending id order whatever the
    order of ``aux_ids``. ``call(layer, hidden, residual)`` runs one layer; ``prepare`` (before the
    collection at each layer) and ``finish_aux`` (on each collected state) are hooks for vLLM's
    sequence-parallel gathers. Returns ``(hidden_states, residual, aux)``.
    """
    # () is the inner model's default: collect nothing. Anything else must be usable ids.
    requested = tuple(aux_ids)
    wanted = check_aux_layer_ids(requested) if requested else []
    end_layer = start_layer + len(layers)
    aux: list[Any] = []
    for offset, layer in enumerate(layers):
        if prepare is not None:
            hidden_states, residual = prepare(layer, hidden_states, residual)
        if start_layer + offset in wanted:
            state = hidden_states + residual
            aux.append(finish_aux(state) if finish_aux is not None else state)
        hidden_states, residual = call(layer, hidden_states, residual)
    if collect_final and end_layer in wanted:
        aux.append(hidden_states + residual)
    return hidden_states, residual, aux


def _make_inner_forward(mod: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepseekV2Model.forward of the installed release, plus aux collection (0.26's behaviour).

    The helpers are taken from the installed deepseek_v2 module itself, so pipeline parallelism
    (IntermediateTensors), inputs_embeds and llama-4 scaling behave exactly as the release's own
    forward; the sequence-parallel all-gathers run only where the release has them (0.26).
    """
    import torch

    get_pp_group = mod.get_pp_group
    intermediate_tensors_cls = mod.IntermediateTensors
    all_gather = getattr(mod, "tensor_model_parallel_all_gather", None)
    llama_4_scaling_fn = getattr(mod, "_get_llama_4_scaling", None)

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                if input_ids is None:
                    raise ValueError("Either input_ids or inputs_embeds must be provided to DeepseekV2Model.forward")
                hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        scaling_cfg = getattr(self.config, "llama_4_scaling", None)
        llama_4_scaling = None
        if scaling_cfg is not None and llama_4_scaling_fn is not None:
            llama_4_scaling = llama_4_scaling_fn(
                original_max_position_embeddings=scaling_cfg["original_max_position_embeddings"],
                scaling_beta=scaling_cfg["beta"],
                positions=positions,
            )
        n_tokens = positions.shape[0]

        def gather_states(hidden, res):
            # 0.26 sequence-parallel MoE: tokens are sharded across TP ranks between layers.
            combined = all_gather(torch.cat([hidden, res], dim=-1), 0)[:n_tokens]
            hidden, res = combined.split([self.hidden_size, self.hidden_size], dim=-1)
            return hidden, res.contiguous()  # fused_add_rms_norm needs a contiguous residual

        def prepare(layer, hidden, res):
            if (
                all_gather is not None
                and hasattr(layer, "use_sequence_parallel_moe")
                and hidden.shape[0] != n_tokens
                and not layer.use_sequence_parallel_moe
            ):
                return gather_states(hidden, res)
            return hidden, res

        def finish_aux(state):
            if all_gather is not None and state.shape[0] != n_tokens:
                state = all_gather(state, 0)[:n_tokens]
            return state

        hidden_states, residual, aux_hidden_states = run_layers_collecting_aux(
            list(self.layers)[self.start_layer : self.end_layer],
            hidden_states,
            residual,
            self.aux_hidden_state_layers,
            call=lambda layer, h, r: layer(positions, h, r, llama_4_scaling),
            start_layer=self.start_layer,
            prepare=prepare,
            finish_aux=finish_aux,
            collect_final=False,  # the final state exists only on the last PP rank, after the gather below
        )

        if not get_pp_group().is_last_rank:
            return intermediate_tensors_cls({"hidden_states": hidden_states, "residual": residual})

        if all_gather is not None and hidden_states.shape[0] != n_tokens:
            hidden_states, residual = gather_states(hidden_states, residual)
        if self.end_layer in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states + residual)

        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) > 0:
            return hidden_states, aux_hidden_states
        return hidden_states

    # torch.compile support binds arguments by the release's own signature: keep it identical.
    forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    forward.__annotations__ = dict(getattr(original, "__annotations__", {}))
    forward.__doc__ = "eagle3lab: DeepseekV2Model.forward with EAGLE-3 aux hidden-state collection."
    forward.__eagle3lab__ = True  # type: ignore[attr-defined]
    return forward


# --------------------------------------------------------------------------------------------------
# Members installed on the top-level classes
# --------------------------------------------------------------------------------------------------


def _causal_lm_set_aux(self: Any, layers: tuple[int, ...]) -> None:
    """Which layers' inputs the inner model returns as aux hidden states (vLLM ids)."""
    self.model.aux_hidden_state_layers = tuple(check_aux_layer_ids(layers, int(self.config.num_hidden_layers)))


def _causal_lm_default_aux(self: Any) -> tuple[int, ...]:
    """vLLM's default rule (2, L//2, L-3), L read from the config."""
    return tuple(default_aux_layer_ids(int(self.config.num_hidden_layers)))


def _wrapper_set_aux(self: Any, layers: tuple[int, ...]) -> None:
    """The multimodal wrapper delegates to its language model."""
    self.language_model.set_aux_hidden_state_layers(layers)


def _wrapper_getter(name: str) -> Callable[[Any], tuple[int, ...]]:
    def getter(self: Any) -> tuple[int, ...]:
        return getattr(self.language_model, name)()

    getter.__name__ = name
    getter.__doc__ = "Delegates to the language model's default aux layers."
    return getter


# --------------------------------------------------------------------------------------------------
# Registry operations
# --------------------------------------------------------------------------------------------------


def _record(group: str, target: Any, attribute: str, replacement: Any) -> PatchRecord:
    if attribute in ("__bases__", "__code__"):  # always present; never in a class's own __dict__
        original = getattr(target, attribute)
    else:
        original = target.__dict__.get(attribute, MISSING)
    rec = PatchRecord(target, attribute, original, replacement)
    _install(target, attribute, replacement)
    _REGISTRY.setdefault(group, []).append(rec)
    return rec


def _install(target: Any, attribute: str, value: Any) -> None:
    if value is MISSING:
        if attribute in target.__dict__:
            delattr(target, attribute)
    else:
        setattr(target, attribute, value)
    if attribute == "__bases__" or attribute in _EAGLE3_ONLY:
        _clear_protocol_caches()


def _clear_protocol_caches() -> None:
    # ABCMeta caches isinstance results per class; a bases change must not leave a stale verdict.
    mod = sys.modules.get("vllm.model_executor.models.interfaces")
    if mod is None:
        return
    for name in ("SupportsEagle3", "SupportsEagle", "SupportsEagleBase"):
        proto = getattr(mod, name, None)
        if proto is not None and hasattr(proto, "_abc_caches_clear"):
            proto._abc_caches_clear()


def applied() -> dict[str, list[str]]:
    """What is applied now: group -> descriptions of its changes."""
    return {g: [r.describe() for r in recs] for g, recs in _REGISTRY.items()}


def revert() -> list[str]:
    """Undo everything (patch and legacy simulation), newest first; returns what was undone."""
    undone = []
    for group in reversed(list(_REGISTRY)):
        for rec in reversed(_REGISTRY[group]):
            _install(rec.target, rec.attribute, rec.original)
            undone.append("undo " + rec.describe())
        del _REGISTRY[group]
    return undone


# --------------------------------------------------------------------------------------------------
# The installed vLLM (through vllm_compat)
# --------------------------------------------------------------------------------------------------

vllm_version = vllm_compat.vllm_version  # the notebooks and reports read it from here too


def _interfaces() -> Any:
    return vllm_compat.interfaces()


def _classes() -> dict[str, type]:
    """The classes the patch changes, imported from the same modules vLLM's registry loads."""
    ds = vllm_compat.import_module(_DEEPSEEK_MODULE)
    kimi = vllm_compat.import_module(_KIMI_MODULE)
    return {
        "DeepseekV2Model": ds.DeepseekV2Model,
        "DeepseekV2ForCausalLM": ds.DeepseekV2ForCausalLM,
        "DeepseekV3ForCausalLM": ds.DeepseekV3ForCausalLM,
        "KimiK25ForConditionalGeneration": kimi.KimiK25ForConditionalGeneration,
    }


def protocol_members() -> list[str]:
    """Members of the installed ``SupportsEagle3`` Protocol."""
    return eagle3_protocol_members()


def interface_matrix(arches: Iterable[str] = ARCHES) -> list[dict[str, Any]]:
    """One row per architecture: its InterfaceReport as a dict, plus ``arch`` and ``refusal``.

    ValueError when an architecture cannot be loaded (not registered, or its module fails to import).
    """
    rows = []
    for arch in arches:
        cls = vllm_compat.load_model_class(arch)
        row = {"arch": arch, **interface_report(cls).to_dict()}
        row["refusal"] = refusal_for(cls)
        rows.append(row)
    return rows


def refusal_for(model_cls: type) -> str | None:
    """vLLM's model-runner error for an EAGLE-3 drafter on ``model_cls``, or None when it would pass.

    Uses the runner's own test (``supports_eagle3``) on the class; the class answer is the instances'
    answer once the interface is a nominal base.
    """
    if not isinstance(model_cls, type):
        model_cls = type(model_cls)
    return None if vllm_compat.supports_eagle3(model_cls) else vllm_compat.REFUSAL_MESSAGE


def native_support() -> bool:
    """Whether the installed classes carry EAGLE-3 by themselves (vLLM >= 0.18), ignoring our changes."""
    if LEGACY in _REGISTRY or PATCH in _REGISTRY:
        # Judge from the recorded originals of the bases.
        for rec in _REGISTRY.get(LEGACY, []) + _REGISTRY.get(PATCH, []):
            if rec.attribute == "__bases__":
                return _interfaces().SupportsEagle3 in _mro_of_bases(rec.original)
    sup = _interfaces().SupportsEagle3
    c = _classes()
    return all(sup in c[n].__mro__ for n in ("DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"))


def _mro_of_bases(bases: tuple[type, ...]) -> set[type]:
    return {k for b in bases for k in b.__mro__}


# --------------------------------------------------------------------------------------------------
# The 0.17 front-end gate (SpeculativeConfig's model-type allow-list for eagle3)
# --------------------------------------------------------------------------------------------------


def frontend_admits(model_type: str) -> bool:
    """Whether SpeculativeConfig lets ``method='eagle3'`` through for ``model_type`` in this process now."""
    return vllm_compat.frontend_admits(model_type)


def _patch_gate(group: str, types: Sequence[str] = GATE_MODEL_TYPES) -> list[PatchRecord]:
    recs = []
    for gate in vllm_compat.frontend_gates():
        func, i = vllm_compat.gate_function(gate), vllm_compat.gate_constant_index(gate)
        if func is None or i is None:
            raise ValueError(
                f"front-end gate {gate.file}:{gate.line}: cannot find the allow-list constant in "
                f"SpeculativeConfig.{gate.function}; the patch cannot admit {list(types)}"
            )
        allow = func.__code__.co_consts[i]
        missing = tuple(t for t in types if t not in allow)
        if not missing:
            continue
        consts = list(func.__code__.co_consts)
        consts[i] = allow + missing
        # The list is a literal inside the validator: extending the constant it is built from is the
        # smallest reversible change (pydantic holds the function object, whose code we swap).
        recs.append(_record(group, func, "__code__", func.__code__.replace(co_consts=tuple(consts))))
    return recs


# --------------------------------------------------------------------------------------------------
# apply / simulate_legacy
# --------------------------------------------------------------------------------------------------


def _safe_matrix(arches: Iterable[str] = ARCHES) -> list[dict[str, Any]]:
    try:
        return interface_matrix(arches)
    except (ValueError, ImportError) as exc:
        return [{"error": str(exc)}]


def _getter_names(members: Iterable[str]) -> list[str]:
    names = [m for m in members if m in _GETTERS]
    return names or list(_GETTERS[:1])


def apply(
    force: bool = False, legacy_simulation: bool = False, architectures: Sequence[str] | None = None,
) -> PatchReport:
    """Give registered architectures EAGLE-3 support in this process; idempotent.

    ``architectures`` None (or empty): the DeepSeek-V2/V3 and Kimi-K2.5 classes, the family the workbook was
    built for. A no-op (reported) where the installed vLLM supports EAGLE-3 natively, unless ``force`` (then our
    members and forward replace the native ones, to compare them on a GPU; DeepSeek family only).
    ``legacy_simulation`` first runs :func:`simulate_legacy` (vLLM >= 0.18, DeepSeek family).

    Any other architecture is patched by the plan :func:`eagle3lab.diagnose.plan.plan_for` reads from the
    installed classes, the same plan ``diagnose`` prints. ValueError when one is not patchable (the plan's
    one-line reason) or cannot be loaded; nothing is left half-applied.
    """
    general = [a for a in (architectures or ()) if a not in ARCHES]
    family = not architectures or len(general) < len(architectures)
    pre_actions: list[str] = []
    if legacy_simulation:
        pre_actions = [f"legacy simulation: {a}" for a in simulate_legacy().actions]
    rep = PatchReport(vllm_version=vllm_version(), operation="apply", forced=force, actions=pre_actions)
    rep.legacy_simulation = LEGACY in _REGISTRY
    shown = [*(ARCHES if family else ()), *general]
    rep.before = _safe_matrix(shown)
    notes: list[str] = []
    if family:
        rep.native_support = native_support()
        if _family_applied():
            notes.append("already applied in this process")
        elif rep.native_support and not rep.legacy_simulation and not force:
            notes.append(f"vLLM {rep.vllm_version} supports EAGLE-3 natively for these classes "
                         "(use force=True to install ours)")
        else:
            rep.actions += [r.describe() for r in _apply_patch()]
    if general and force:
        raise ValueError(f"force=True replaces vLLM's own EAGLE-3 forward for the DeepSeek family only, not {general}")
    for arch in general:
        done, note = _apply_general(arch)
        rep.actions += done
        if note:
            notes.append(f"{arch}: {note}" if architectures and len(architectures) > 1 else note)
    if not rep.actions:
        rep.noop, rep.reason = True, "; ".join(notes) or "nothing to change"
    rep.gate = {t: frontend_admits(t) for t in (*(GATE_MODEL_TYPES if family else ()), *_gate_types(general))}
    rep.after = _safe_matrix(shown)
    return rep


def _family_applied() -> bool:
    return any(rec.attribute == "forward" and getattr(rec.target, "__name__", "") == "DeepseekV2Model"
               for rec in _REGISTRY.get(PATCH, []))


def plan(arch: str) -> PatchPlan:
    """The plan for one registered architecture on the installed vLLM (ValueError when it cannot be loaded)."""
    cls = vllm_compat.load_model_class(arch)
    return plan_for(cls, levels=level_chain(cls, []))


def _apply_general(arch: str) -> tuple[list[str], str]:
    """Execute ``arch``'s plan: (descriptions of the changes, a note when there was nothing to change)."""
    p = plan(arch)
    if p.verdict == "unsupported":
        raise ValueError(f"{arch} is not patchable on vLLM {vllm_version()}: {p.reason}")
    cls = vllm_compat.load_model_class(arch)
    if p.verdict == "native":
        mine = any(getattr(r.target, "__name__", "") in p.levels for r in _REGISTRY.get(PATCH, []))
        alias = [r.describe() + " (image_token_index for vLLM's EAGLE proposer)" for r in _alias_placeholder(cls)]
        return alias, "already applied in this process" if mine else f"vLLM {vllm_version()} supports it natively"
    by_name = {k.__name__: k for lv in level_chain(cls, []) for k in _level_class(lv).__mro__}
    members = protocol_members()
    sup = _interfaces().SupportsEagle3
    recs: list[PatchRecord] = []
    before = len(_REGISTRY.setdefault(PATCH, []))
    try:
        for step in p.interface:
            recs += _install_interface(by_name[step.owner], step, sup, members)
        if p.forward is not None and p.inner is not None and p.forward_owner is not None:
            inner, owner = by_name[p.inner], by_name[p.forward_owner]
            if not hasattr(inner, "aux_hidden_state_layers"):
                recs.append(_record(PATCH, inner, "aux_hidden_state_layers", ()))
            mod = sys.modules[owner.__module__]
            if p.forward == "deepseek":
                fwd = _make_inner_forward(mod, owner.forward)
            else:
                for name, helper in ((layer_loop.OUT_HELPER, layer_loop.aux_out),
                                     (layer_loop.STATE_HELPER, layer_loop.aux_state)):
                    if mod.__dict__.get(name) is not helper:
                        recs.append(_record(PATCH, mod, name, helper))
                fwd = _rewritten_forward(owner, p)
            recs.append(_record(PATCH, inner, "forward", fwd))
        recs += _patch_gate(PATCH, _gate_types([arch]))
        recs += _alias_placeholder(cls)
        if not vllm_compat.supports_eagle3(cls):
            raise ValueError(f"{arch}: the plan ran but supports_eagle3 is still False")
    except Exception:
        for rec in reversed(_REGISTRY[PATCH][before:]):
            _install(rec.target, rec.attribute, rec.original)
        del _REGISTRY[PATCH][before:]
        if not _REGISTRY[PATCH]:
            del _REGISTRY[PATCH]
        raise
    return [r.describe() for r in recs], ""


# vLLM's EAGLE proposer (v1/spec_decode/llm_base_proposer.py, load_model) reads ``config.image_token_index`` from any
# multimodal target whose class is not on its own list of names. Kimi-VL's config spells that token
# media_placeholder_token_id, so the drafter's load died with AttributeError on vLLM 0.32, native support and all
# (tests/test_serve.py::test_kimi_vl_serves_with_a_drafter_on_vllm_cpu, 2026-12-07). The spellings it is read from:
PLACEHOLDER_SPELLINGS = ("media_placeholder_token_id", "image_token_id")


def alias_image_token_index(config: Any) -> str | None:
    """Give ``config`` the ``image_token_index`` vLLM's EAGLE proposer reads, from another spelling of the same
    token; returns the spelling used (None: already present, or no spelling to take it from)."""
    if config is None or hasattr(config, "image_token_index"):
        return None
    for name in PLACEHOLDER_SPELLINGS:
        value = getattr(config, name, None)
        if value is not None:
            config.image_token_index = value
            return name
    return None


def _aliasing_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        alias_image_token_index(getattr(self, "config", None))

    __init__.eagle3lab_alias = True  # type: ignore[attr-defined]
    return __init__


def _alias_placeholder(cls: type) -> list[PatchRecord]:
    """For a multimodal wrapper: alias its config's image token for vLLM's EAGLE proposer (once)."""
    if not getattr(cls, "supports_multimodal", False) or getattr(cls.__init__, "eagle3lab_alias", False):
        return []
    return [_record(PATCH, cls, "__init__", _aliasing_init(cls.__init__))]


def _level_class(level: Any) -> type:
    return getattr(sys.modules[level.module], level.class_name)


def _install_interface(owner: type, step: InterfaceStep, sup: type, members: list[str]) -> list[PatchRecord]:
    recs = []
    if sup not in owner.__mro__:
        # Nominal inheritance: isinstance passes for the class, its instances and subclasses.
        recs.append(_record(PATCH, owner, "__bases__", (*owner.__bases__, sup)))
    recs.append(_record(PATCH, owner, "supports_eagle3", True))
    if step.leaf:
        recs.append(_record(PATCH, owner, "set_aux_hidden_state_layers", _leaf_setter(step.child)))
        for g in _getter_names(members):
            recs.append(_record(PATCH, owner, g, _leaf_default(step.child, g)))
    else:
        recs.append(_record(PATCH, owner, "set_aux_hidden_state_layers", _delegating_setter(step.child)))
        for g in _getter_names(members):
            recs.append(_record(PATCH, owner, g, _delegating_getter(step.child, g)))
    return recs


def _num_layers(inner: Any) -> int:
    layers = getattr(inner, "layers", None)
    return len(layers) if layers is not None else int(inner.config.num_hidden_layers)


def _leaf_setter(child: str) -> Callable[[Any, tuple[int, ...]], None]:
    def set_aux_hidden_state_layers(self: Any, layers: tuple[int, ...]) -> None:
        """Which layers' inputs the inner model returns as aux hidden states (vLLM ids)."""
        inner = getattr(self, child)
        inner.aux_hidden_state_layers = tuple(check_aux_layer_ids(layers, _num_layers(inner)))

    return set_aux_hidden_state_layers


def _leaf_default(child: str, name: str) -> Callable[[Any], tuple[int, ...]]:
    def getter(self: Any) -> tuple[int, ...]:
        return tuple(default_aux_layer_ids(_num_layers(getattr(self, child))))

    getter.__name__ = name
    getter.__doc__ = "vLLM's default rule (2, L//2, L-3), L the inner model's layer count."
    return getter


def _delegating_setter(child: str) -> Callable[[Any, tuple[int, ...]], None]:
    def set_aux_hidden_state_layers(self: Any, layers: tuple[int, ...]) -> None:
        """A wrapper delegates to the model it holds."""
        getattr(self, child).set_aux_hidden_state_layers(layers)

    return set_aux_hidden_state_layers


def _delegating_getter(child: str, name: str) -> Callable[[Any], tuple[int, ...]]:
    def getter(self: Any) -> tuple[int, ...]:
        return getattr(getattr(self, child), name)()

    getter.__name__ = name
    getter.__doc__ = f"Delegates to self.{child}."
    return getter


def _forward_file(owner: type, src: str) -> Path:
    """A real file holding ``src``, named by its content, for the rewritten forward's code object.

    vLLM's torch.compile cache is keyed by the text of every traced source file, read from disk; a synthetic file
    name (``<...>``) cannot be read (vLLM logs "Failed to read file") and leaves our forward out of the key, so a
    cache compiled with another rewrite could be reused. A content-named file keeps the key exact, and tracebacks
    and ``inspect.getsource`` show the code that runs. Written atomically: every vLLM worker writes the same bytes.
    """
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    name = f"{owner.__module__}.{owner.__qualname__}.forward.{digest}.py"
    for base in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"), Path(tempfile.gettempdir())):
        folder = base / "eagle3lab" / "forwards"
        path = folder / name
        try:
            if not (path.is_file() and path.read_text() == src):
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".{name}.{os.getpid()}.tmp"
                tmp.write_text(src)
                tmp.replace(path)
            return path
        except OSError:
            continue  # a read-only home: the temp folder
    raise OSError(f"nowhere to write the rewritten forward {name}")


def _rewritten_forward(owner: type, p: PatchPlan) -> Callable[..., Any]:
    """``owner.forward`` of the installed release with aux collection added (:mod:`eagle3lab.layer_loop`),
    compiled in the model's own module so that every name it uses resolves as in the original."""
    original = inspect.unwrap(owner.__dict__["forward"])
    body = layer_loop.rewrite_forward(inspect.getsource(original), p.loop)
    # A factory gives the function the __class__ cell that super() needs; annotations stay unevaluated strings
    # (names imported for type checking only must not be looked up).
    src = "def _eagle3lab_factory(__class__):\n" + textwrap.indent(body, "    ") + f"    return {original.__name__}\n"
    code = compile(src, str(_forward_file(owner, src)), "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    scope: dict[str, Any] = {}
    exec(code, sys.modules[owner.__module__].__dict__, scope)  # noqa: S102 - the installed forward, rewritten
    forward = scope["_eagle3lab_factory"](owner)
    # torch.compile support binds arguments by the release's own signature: keep it identical.
    forward.__signature__ = inspect.signature(original)
    forward.__annotations__ = dict(getattr(original, "__annotations__", {}))
    forward.__qualname__ = f"{owner.__qualname__}.forward"
    forward.__doc__ = f"eagle3lab: {owner.__name__}.forward with EAGLE-3 aux hidden-state collection."
    forward.__eagle3lab__ = True
    return forward


def _gate_types(architectures: Iterable[str]) -> tuple[str, ...]:
    """Model types 0.17's front-end allow-list must admit for these architectures: the model module's name
    (vLLM names modules after the model type, e.g. glm4_moe) and transformers' model type for the class name."""
    out: list[str] = []
    for arch in architectures:
        entry = vllm_compat.model_registry().models.get(arch)
        module = getattr(entry, "module_name", "") or ""
        out.append(module.rsplit(".", 1)[-1])
        out += [t for t, names in _transformers_causal_lm_names().items() if arch in names]
    return tuple(dict.fromkeys(t for t in out if t))


def _transformers_causal_lm_names() -> dict[str, tuple[str, ...]]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    except ImportError:
        return {}
    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in names.items()}


def _apply_patch() -> list[PatchRecord]:
    c = _classes()
    sup = _interfaces().SupportsEagle3
    members = protocol_members()
    getters = _getter_names(members)
    recs: list[PatchRecord] = []
    _REGISTRY.setdefault(PATCH, [])
    try:
        for name, setter, getter_for in (
            ("DeepseekV2ForCausalLM", _causal_lm_set_aux, lambda n: _causal_lm_default_aux),
            ("KimiK25ForConditionalGeneration", _wrapper_set_aux, _wrapper_getter),
        ):
            cls = c[name]
            if sup not in cls.__mro__:
                # Nominal inheritance: isinstance passes for the class, its instances and subclasses.
                recs.append(_record(PATCH, cls, "__bases__", (*cls.__bases__, sup)))
            recs.append(_record(PATCH, cls, "supports_eagle3", True))
            recs.append(_record(PATCH, cls, "set_aux_hidden_state_layers", setter))
            for g in getters:
                recs.append(_record(PATCH, cls, g, getter_for(g)))
        inner = c["DeepseekV2Model"]
        if "aux_hidden_state_layers" not in inner.__dict__:
            recs.append(_record(PATCH, inner, "aux_hidden_state_layers", ()))
        mod = sys.modules[inner.__module__]
        recs.append(_record(PATCH, inner, "forward", _make_inner_forward(mod, inner.forward)))
        recs += _patch_gate(PATCH)
    except Exception:
        revert_group(PATCH)
        raise
    return recs


def revert_group(group: str) -> list[str]:
    """Undo one group (PATCH or LEGACY) only; the other stays."""
    undone = []
    for rec in reversed(_REGISTRY.pop(group, [])):
        _install(rec.target, rec.attribute, rec.original)
        undone.append("undo " + rec.describe())
    return undone


def simulate_legacy() -> PatchReport:
    """LEGACY SIMULATION (vLLM >= 0.18): remove native EAGLE-3 support to reproduce the 0.15-0.17 refusal.

    ``SupportsEagle3`` leaves the bases of DeepseekV2ForCausalLM and KimiK25ForConditionalGeneration and
    the EAGLE-3 members leave their class dicts, so ``supports_eagle3`` is False for them, their
    instances and subclasses (DeepseekV3ForCausalLM). The inner model's native forward stays: with the
    interface gone nothing can set its aux layers, so it behaves like 0.17's; :func:`apply` afterwards
    installs our forward over it, exactly as on 0.17. A reported no-op on 0.15-0.17. Reversible.
    """
    rep = PatchReport(vllm_version=vllm_version(), operation="simulate_legacy", legacy_simulation=True)
    rep.native_support = native_support()
    rep.before = _safe_matrix()
    if LEGACY in _REGISTRY:
        rep.noop, rep.reason = True, "legacy simulation already active in this process"
    elif PATCH in _REGISTRY:
        raise ValueError("simulate_legacy: the patch is applied in this process; call revert() first")
    elif not rep.native_support:
        rep.noop = True
        rep.reason = f"vLLM {rep.vllm_version} has no native EAGLE-3 support for these classes: nothing to simulate"
        rep.legacy_simulation = False
    else:
        rep.actions = [r.describe() for r in _simulate()]
    rep.after = _safe_matrix()
    return rep


def _simulate() -> list[PatchRecord]:
    c = _classes()
    sup = _interfaces().SupportsEagle3
    recs: list[PatchRecord] = []
    _REGISTRY.setdefault(LEGACY, [])
    try:
        for name in ("DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"):
            cls = c[name]
            if sup in cls.__bases__:
                recs.append(_record(LEGACY, cls, "__bases__", tuple(b for b in cls.__bases__ if b is not sup)))
            elif sup in cls.__mro__:
                raise ValueError(f"simulate_legacy: {name} inherits SupportsEagle3 indirectly; cannot simulate")
            for m in _EAGLE3_ONLY:
                if m in cls.__dict__:
                    recs.append(_record(LEGACY, cls, m, MISSING))
        still = [n for n in ARCHES if _interfaces().supports_eagle3(c[n])]
        if still:
            raise ValueError(f"simulate_legacy: {still} still pass supports_eagle3 after the simulation")
    except Exception:
        revert_group(LEGACY)
        raise
    return recs
