"""What our patch would change for one registered class, or precisely why it will not patch it.

This is the single source of truth shared by ``diagnose`` (the verdict and the plan it prints) and
:mod:`eagle3lab.patch` (which executes exactly this plan), so the two cannot disagree. The plan is found by
reading the installed classes, not by family names:

1. walk from the registered class down to the model that builds ``self.layers`` (:mod:`.levels`);
2. refuse what we do not patch: hybrid (recurrent-state) models, decoder layers that hold several attention
   sublayers each, a chain with no text model that runs layers;
3. read the inner model's ``forward``: already collecting aux states (vLLM's own support), or a standard
   layer loop (:mod:`eagle3lab.layer_loop`), or not standard (refused with the loop's reason);
4. every level above it that is not a ``SupportsEagle3`` gets the interface, its setters and getters
   delegating down to the attribute that holds the next level.
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from eagle3lab import layer_loop
from eagle3lab.diagnose.levels import Level, _defining_init, _self_assignments, _source_of, level_chain

# DeepSeek-V2's inner model has a hand-written forward in the patch (its 0.26 sequence-parallel MoE shards the
# tokens between layers, which the generic rewrite does not gather): the family the workbook was built for.
DEEPSEEK_INNER = "DeepseekV2Model"
# Attributes of a decoder layer that hold its attention; a ModuleList there means several attention sublayers
# per layer (LongCat-Flash), where "the input of layer k" names no single point of the residual stream.
_ATTENTION_ATTRS = ("self_attn", "attn", "attention")


@dataclass
class InterfaceStep:
    """Give ``owner`` (a class in the level's MRO) ``SupportsEagle3``, delegating through ``child``."""

    level_class: str
    owner: str  # where the members go: the class whose __init__ builds the child (subclasses inherit them)
    child: str  # attribute holding the next level
    leaf: bool  # the child is the inner model (aux layers are set on it); else it is another EAGLE-3 level
    missing: list[str] = field(default_factory=list)


@dataclass
class PatchPlan:
    """The verdict for one class and, when patchable, the changes that make vLLM accept it."""

    architecture: str
    verdict: str  # "native" | "patchable" | "unsupported"
    reason: str  # one line: why unsupported, or what the patch does
    levels: list[str]
    interface: list[InterfaceStep] = field(default_factory=list)
    inner: str | None = None  # the class whose forward runs the layers
    forward: str | None = None  # "deepseek" (hand-written), "rewrite" (layer_loop), None (nothing to do)
    forward_owner: str | None = None  # the class in the inner model's MRO whose forward is replaced
    loop: layer_loop.LayerLoop | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def _owner_of(cls: type, attribute: str) -> type:
    """The class in ``cls``'s MRO whose own ``__init__`` assigns ``self.<attribute>`` (else ``cls``)."""
    for klass in cls.__mro__:
        if klass is object or "__init__" not in klass.__dict__:
            continue
        init, _ = _defining_init(klass)
        if attribute in _self_assignments(init):
            return klass
        break
    return cls


def _forward_owner(cls: type) -> type:
    return next((k for k in cls.__mro__ if "forward" in k.__dict__), cls)


def _is_hybrid(levels: list[Level]) -> str | None:
    for lv in levels:
        cls = _class(lv)
        if getattr(cls, "is_hybrid", False) is True:
            return lv.class_name
    return None


def _is_attention_free(levels: list[Level]) -> str | None:
    """vLLM's IsAttentionFree (Mamba-only models): the first level that declares it."""
    for lv in levels:
        if getattr(_class(lv), "is_attention_free", False) is True:
            return lv.class_name
    return None


def _class(level: Level) -> type:
    return getattr(sys.modules[level.module], level.class_name)


def decoder_layer_classes(inner: type, callers: list[type] | None = None) -> list[type]:
    """The decoder layer classes that the inner model's ``self.layers = ...`` statement builds.

    A name there is a class of the model's module, or a parameter of the ``__init__`` that builds the layers
    (``layer_type`` in Llama's family): then the class is what a subclass of the inner model passes for it
    (``super().__init__(..., layer_type=X)``), else what a caller passes (the levels above, ``callers``:
    ``InnerModel(..., layer_type=X)``), else the parameter's default. Names that resolve to nothing are left out.
    """
    init, env = _defining_init(inner)
    value = _self_assignments(init).get(layer_loop.LAYERS)
    if value is None or init is None:
        return []
    params = {a.arg: a for a in init.args.posonlyargs + init.args.args + init.args.kwonlyargs}
    found: list[type] = []
    for node in ast.walk(value):
        if not isinstance(node, ast.Name):
            continue
        obj = env.get(node.id)
        if obj is None and node.id in params:
            obj = _argument_class(node.id, init, inner, callers or [])
        if isinstance(obj, type) and obj not in found and hasattr(obj, "forward"):
            found.append(obj)
    return found


def _keyword_class(klass: type, keyword: str, callee: str | None = None) -> type | None:
    """The class passed as ``keyword=X`` in a call inside ``klass``'s own ``__init__`` (to ``callee`` only, if
    given: a call whose function's name ends with it), resolved in its module; None if there is none."""
    if "__init__" not in klass.__dict__:
        return None
    init, env = _defining_init(klass)
    for node in ast.walk(init) if init is not None else []:
        if not isinstance(node, ast.Call):
            continue
        if callee is not None and ast.unparse(node.func).split(".")[-1] != callee:
            continue
        for kw in node.keywords:
            if kw.arg == keyword and isinstance(kw.value, (ast.Name, ast.Attribute)):
                obj = env.get(kw.value.id) if isinstance(kw.value, ast.Name) else None
                if isinstance(obj, type):
                    return obj
    return None


def _argument_class(param: str, init: ast.FunctionDef, inner: type, callers: list[type]) -> type | None:
    """The class bound to ``init``'s parameter ``param`` when ``inner`` is built (see decoder_layer_classes)."""
    for klass in inner.__mro__:  # a subclass between inner and the defining class passes it up
        if klass is object:
            break
        found = _keyword_class(klass, param, callee="__init__")
        if found is not None:
            return found
    for caller in callers:
        for klass in caller.__mro__:
            if klass is object:
                break
            found = _keyword_class(klass, param, callee=inner.__name__)
            if found is not None:
                return found
    args = init.args
    defaults = dict(zip([a.arg for a in (args.posonlyargs + args.args)][::-1], args.defaults[::-1], strict=False))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None})
    default = defaults.get(param)
    if isinstance(default, ast.Name):
        module = sys.modules.get(next((k.__module__ for k in inner.__mro__ if "__init__" in k.__dict__),
                                      inner.__module__))
        owner_env = vars(module) if module else {}
        _, env = _defining_init(inner)
        obj = env.get(default.id, owner_env.get(default.id))
        return obj if isinstance(obj, type) else None
    return None


def stream_convention(layer_classes: list[type], loop: layer_loop.LayerLoop) -> tuple[bool | None, str]:
    """Whether the residual stream at a layer's input is hidden + residual (True) or hidden alone (False), read
    from every decoder layer class's own forward (:func:`eagle3lab.layer_loop.residual_convention`), with the
    reason in one line; None when it cannot be told (no layer class found, a forward without source, layers that
    disagree, or a pattern whose stream is not known)."""
    if loop.residual is None:
        return False, "return the stream itself, no separate residual"
    if not layer_classes:
        return None, ("the class of its decoder layers cannot be read from `self.layers = ...` (chosen at run time "
                      "or through a table), so what its layers do with the residual is unknown")
    if loop.residual_arg is None:
        return None, f"its loop does not pass `{loop.residual}` to the layer as itself"
    seen: dict[str, list[str]] = {}
    for cls in layer_classes:
        owner = _forward_owner(cls)
        src = _source_of(inspect.unwrap(owner.__dict__["forward"])) if "forward" in owner.__dict__ else None
        if src is None:
            return None, f"{cls.__name__}.forward has no readable source"
        use = layer_loop.residual_convention(src, loop.residual_arg, loop.hidden_arg)
        if not use.known:
            return None, f"{owner.__name__}.forward: what it does with the residual is unknown: {use.why}"
        seen.setdefault(use.convention, []).append(f"{owner.__name__} ({use.why})")
    if len(seen) > 1:
        return None, "its decoder layers differ: " + "; ".join(f"{c}: {', '.join(v)}" for c, v in seen.items())
    (convention, where), = seen.items()
    return convention == layer_loop.FUSED, f"{convention}: {where[0]}"


def _multi_attention(layer_cls: type) -> str | None:
    """The attribute of a decoder layer holding a list of attention sublayers, if any."""
    init, _ = _defining_init(layer_cls)
    assigns = _self_assignments(init)
    for attr in _ATTENTION_ATTRS:
        value = assigns.get(attr)
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "ModuleList":
            return attr
    return None


def plan_for(cls: type, text_architectures: list[str] | None = None, levels: list[Level] | None = None) -> PatchPlan:
    """The patch plan for the registered class ``cls`` on the installed vLLM (see the module docstring)."""
    levels = levels if levels is not None else level_chain(cls, text_architectures)
    names = [lv.class_name for lv in levels]

    def refuse(reason: str, **kw: Any) -> PatchPlan:
        return PatchPlan(cls.__name__, "unsupported", reason, names, **kw)

    if levels and levels[0].supports_eagle3:
        # vLLM's own claim decides, whatever its code looks like inside (Ernie4_5ForCausalLM on 0.26 is native
        # through a parent class although no class of its chain assigns self.layers in its own __init__)
        return PatchPlan(cls.__name__, "native", f"{names[0]} supports EAGLE-3 as installed", names)
    inner_level = next((lv for lv in levels if lv.runs_layers), None)
    hybrid = _is_hybrid(levels)
    if hybrid is not None:
        return refuse(f"{hybrid} is a hybrid model (vLLM's IsHybrid: linear-attention or SSM layers with recurrent "
                      "state): not patched, since EAGLE-3 drafting over its recurrent state is not verified here")
    free = _is_attention_free(levels)
    if free is not None:
        return refuse(f"{free} is attention-free (vLLM's IsAttentionFree: SSM layers only, recurrent state): not "
                      "patched, since EAGLE-3 drafting over its recurrent state is not verified here")
    if inner_level is None:
        return refuse(f"no class in the chain {' -> '.join(names)} builds self.layers: its decoder layers live "
                      "under another name (self.h, self.blocks, ...), its text model is chosen only by a config, or "
                      "it has no text model; the patch rewrites loops over self.layers only")
    inner = _class(inner_level)
    layer_classes = decoder_layer_classes(inner, [_class(lv) for lv in levels[: inner_level.depth]])
    for layer_cls in layer_classes:
        attr = _multi_attention(layer_cls)
        if attr is not None:
            return refuse(f"{layer_cls.__name__}.{attr} is a ModuleList: each decoder layer runs several attention "
                          "sublayers, so a layer id names no single point of the residual stream",
                          inner=inner.__name__)
    owner = _forward_owner(inner)
    if getattr(owner.__dict__.get("forward"), "__eagle3lab__", False):
        forward, loop = None, None  # ours, installed earlier in this process
    elif inner.__name__ == DEEPSEEK_INNER and not inner_level.forward_collects_aux:
        forward, loop = "deepseek", None
    else:
        src = _source_of(inspect.unwrap(owner.__dict__["forward"])) if "forward" in owner.__dict__ else None
        if src is None:
            return refuse(f"{inner.__name__}.forward has no readable source", inner=inner.__name__)
        loop = layer_loop.analyse_forward(src)
        if not loop.ok:
            return refuse(f"{owner.__name__}.forward: {loop.reason}", inner=inner.__name__, loop=loop)
        forward = None if loop.collects_aux else "rewrite"
        if forward == "rewrite":
            adds, why = stream_convention(layer_classes, loop)
            if adds is None:
                return refuse(f"{owner.__name__}: {why}; the aux states would be a guess", inner=inner.__name__,
                              loop=loop)
            loop.stream_adds_residual = adds
            loop.convention = why
    steps = []
    for lv in levels[: inner_level.depth]:
        if lv.supports_eagle3:
            continue
        child = levels[lv.depth + 1]
        level_cls = _class(lv)
        steps.append(InterfaceStep(
            level_class=lv.class_name, owner=_owner_of(level_cls, child.attribute or "").__name__,
            child=child.attribute or "", leaf=child.depth == inner_level.depth,
            missing=list(lv.interface.members_missing),
        ))
    common = dict(inner=inner.__name__, forward=forward, forward_owner=owner.__name__ if forward else None, loop=loop)
    if not steps and forward is None:
        return PatchPlan(cls.__name__, "native", f"{names[0]} supports EAGLE-3 as installed", names, **common)
    what = [f"SupportsEagle3 on {', '.join(s.owner for s in steps)}"] if steps else []
    if forward == "rewrite":
        state = f"{loop.hidden} + {loop.residual}" if loop.residual and loop.stream_adds_residual else loop.hidden
        what.append(f"aux collection added to {owner.__name__}.forward's loop `for ... in {loop.form}` "
                    f"(stream at a layer's input: `{state}`; decoder layers: {loop.convention.split(':')[0]})")
    elif forward == "deepseek":
        what.append(f"{owner.__name__}.forward replaced by the hand-written DeepSeek-V2 forward")
    return PatchPlan(cls.__name__, "patchable", "; ".join(what), names, interface=steps, **common)
