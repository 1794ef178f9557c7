"""Why does vLLM refuse EAGLE-3 for this target, and what would make it accept?

Everything here is found by introspecting the *installed* vLLM (its model registry, ``inspect``, the
``SupportsEagle3`` Protocol, the source text of the installed package) rather than by hard-coded line
numbers or member lists, so the same code answers for every release from 0.15 through 0.26.
No GPU and no weights are needed: an architecture name or a config.json is enough.

vLLM is imported lazily inside the functions, so ``import eagle3lab.diagnose`` stays cheap.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
import re
import sys
import textwrap
import time
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The message vLLM's model runner raises when the loaded target lacks the interface.
REFUSAL_MESSAGE = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
# A shorter variant (the V2 model runner's helper) shares this stem.
_REFUSAL_STEM = "does not support EAGLE3 interface"

# Our patch (eagle3lab.patch) targets the DeepSeek-V2 text stack, which DeepSeek-V3, Kimi-K2/K2.5 and
# GLM-MoE-DSA reuse: these two class names are the anchor of that family.
FAMILY_CAUSAL_LM = "DeepseekV2ForCausalLM"
FAMILY_INNER_MODEL = "DeepseekV2Model"

# Attributes that wrappers conventionally use for the model they delegate to, in preference order.
_CHILD_ATTRS = ("language_model", "model", "text_model", "llm", "lm")

# The Protocol's bookkeeping attributes that are not part of its contract.
_PROTOCOL_NOISE = frozenset(
    {
        "__abstractmethods__", "__annotations__", "__dict__", "__doc__", "__init__", "__module__",
        "__new__", "__slots__", "__subclasshook__", "__weakref__", "__class_getitem__",
        "__parameters__", "__orig_bases__", "__protocol_attrs__", "__non_callable_proto_members__",
        "__static_attributes__", "__firstlineno__", "__type_params__", "__annotate__",
        "__annotate_func__", "__annotations_cache__", "_is_protocol", "_is_runtime_protocol",
        "__callable_proto_members_only__", "__qualname__", "_abc_impl",
    }
)


# --------------------------------------------------------------------------------------------------
# The SupportsEagle3 Protocol
# --------------------------------------------------------------------------------------------------


def _import_vllm() -> Any:
    """Import vLLM with stdout pointed at stderr.

    vLLM's log handler binds ``sys.stdout`` when vLLM is first imported; binding it to stderr instead
    keeps ``eagle3lab diagnose --json`` output parseable. A no-op when vLLM was imported before.
    """
    with contextlib.redirect_stdout(sys.stderr):
        import vllm.model_executor.models.interfaces  # noqa: F401
        import vllm.model_executor.models.registry  # noqa: F401

        import vllm
    return vllm


def _interfaces_module() -> Any:
    _import_vllm()
    from vllm.model_executor.models import interfaces

    return interfaces


def _protocol_members(proto: type) -> list[str]:
    """Members a Protocol requires, read from the Protocol itself (never from a hard-coded list)."""
    attrs = getattr(proto, "__protocol_attrs__", None)  # Python >= 3.12 caches them here
    if attrs is None:
        getter = getattr(typing, "_get_protocol_attrs", None)  # Python 3.10 / 3.11
        if getter is not None:
            try:
                attrs = getter(proto)
            except Exception:  # private helper: fall back to reading the class dicts
                attrs = None
    if attrs is None:
        attrs = set()
        for base in proto.__mro__:
            if base in (object, typing.Protocol, typing.Generic):
                continue
            attrs.update(base.__dict__)
            attrs.update(getattr(base, "__annotations__", {}) or {})
    return sorted(a for a in attrs if a not in _PROTOCOL_NOISE and not a.startswith("_abc_"))


def eagle3_protocol_members() -> list[str]:
    """Names the installed vLLM's ``SupportsEagle3`` Protocol requires (they differ between releases)."""
    return _protocol_members(_interfaces_module().SupportsEagle3)


@dataclass
class InterfaceReport:
    """How one class stands against the installed ``SupportsEagle3`` Protocol."""

    class_name: str
    module: str
    supports_eagle3: bool
    members_present: list[str]
    members_missing: list[str]
    protocol_members: list[str]
    # True when SupportsEagle3 is among the class's bases (nominal), not only matched structurally.
    nominal: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def interface_report(cls: type) -> InterfaceReport:
    """Check ``cls`` (a class, or an instance whose class is used) against ``SupportsEagle3``.

    ``supports_eagle3`` is vLLM's own verdict (``supports_eagle3(cls)``); the member lists are
    ``hasattr`` checks of each member of the installed Protocol, so a patch can be shown before/after.
    """
    if cls is None:
        raise ValueError("interface_report: got None instead of a class (did the registry fail to resolve it?)")
    if not isinstance(cls, type):
        cls = type(cls)
    interfaces = _interfaces_module()
    members = _protocol_members(interfaces.SupportsEagle3)
    return InterfaceReport(
        class_name=cls.__name__,
        module=cls.__module__,
        supports_eagle3=bool(interfaces.supports_eagle3(cls)),
        members_present=[m for m in members if hasattr(cls, m)],
        members_missing=[m for m in members if not hasattr(cls, m)],
        protocol_members=members,
        nominal=interfaces.SupportsEagle3 in cls.__mro__,
    )


def implemented_interfaces(cls: type) -> list[str]:
    """The runtime-checkable ``Supports*`` / ``Has*`` / ``Is*`` Protocols of vLLM that ``cls`` satisfies."""
    interfaces = _interfaces_module()
    out = []
    for name, obj in vars(interfaces).items():
        if not (isinstance(obj, type) and getattr(obj, "_is_runtime_protocol", False)):
            continue
        if not name.startswith(("Supports", "Has", "Is")):
            continue
        try:
            # isinstance on the class object: Protocols with data members refuse issubclass.
            if isinstance(cls, obj):
                out.append(name)
        except TypeError:
            continue
    return sorted(out)


# --------------------------------------------------------------------------------------------------
# Target input
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetInfo:
    """What was learned about the target before touching vLLM."""

    architecture: str
    config_path: str | None = None
    model_type: str | None = None
    text_model_type: str | None = None  # hf_text_config.model_type (text_config's, if any)
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    text_architectures: list[str] = field(default_factory=list)
    model_type_source: str | None = None  # "config.json", "transformers mapping" or None (unknown)


def read_json_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Read a config.json, or the config.json inside a folder; return (dict, file path)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"config not found: {p} (give an architecture name, a config.json or a folder)")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: top level must be a JSON object")
    return cfg, p


def text_config_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's sub-config, as vLLM's ``hf_text_config`` picks it (text_config when present)."""
    for key in ("text_config", "language_config", "llm_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict):
            return sub
    return cfg


def _looks_like_path(target: str) -> bool:
    return "/" in target or "\\" in target or target.endswith(".json") or target.startswith(".")


def target_info(target: str | Path) -> TargetInfo:
    """Turn an architecture name, a config.json or a checkpoint folder into a :class:`TargetInfo`."""
    if isinstance(target, Path) or Path(str(target)).exists() or _looks_like_path(str(target)):
        cfg, p = read_json_config(target)
        archs = cfg.get("architectures") or []
        if not archs or not isinstance(archs, list):
            raise ValueError(f"{p}: no 'architectures' list, so vLLM cannot pick a model class")
        text = text_config_of(cfg)

        def pick(key: str) -> Any:
            return text.get(key, cfg.get(key))

        return TargetInfo(
            architecture=str(archs[0]),
            config_path=str(p),
            model_type=cfg.get("model_type"),
            text_model_type=text.get("model_type", cfg.get("model_type")),
            num_hidden_layers=pick("num_hidden_layers"),
            hidden_size=pick("hidden_size"),
            vocab_size=pick("vocab_size"),
            text_architectures=list(text.get("architectures") or []) if text is not cfg else [],
            model_type_source="config.json",
        )
    name = str(target).strip()
    if not name.isidentifier():
        raise ValueError(f"target {target!r} is neither an architecture name nor an existing config path")
    mt = model_type_for_architecture(name)
    return TargetInfo(
        architecture=name, model_type=mt, text_model_type=mt, model_type_source="transformers mapping" if mt else None
    )


def model_type_for_architecture(arch: str) -> str | None:
    """The model_type whose transformers class is named ``arch`` (reverse of transformers' auto mappings).

    Only a guess for a bare architecture name: a checkpoint's own config.json is authoritative
    (Kimi-K2.5, for one, is not in transformers, and its gate-relevant model_type is its text_config's).
    """
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    candidates: list[str] = []
    for name, mapping in vars(modeling_auto).items():
        if not (name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)):
            continue
        for model_type, cls_names in mapping.items():
            names = cls_names if isinstance(cls_names, (tuple, list)) else (cls_names,)
            if arch in names and model_type not in candidates:
                candidates.append(model_type)
    if not candidates:
        return None

    # Several model_types can share a class (llama, code_llama, exaone...): prefer the one whose name
    # is the architecture's stem (DeepseekV3ForCausalLM -> deepseek_v3).
    def norm(x: str) -> str:
        return "".join(ch for ch in x.lower() if ch.isalnum())

    stem = norm(arch)
    for suffix in ("forcausallm", "forconditionalgeneration", "lmheadmodel", "model"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    exact = [c for c in candidates if norm(c) == stem]
    prefix = sorted((c for c in candidates if stem.startswith(norm(c))), key=len, reverse=True)
    return (exact or prefix or candidates)[0]


# --------------------------------------------------------------------------------------------------
# Walking wrappers down to the model that runs the layers
# --------------------------------------------------------------------------------------------------


@dataclass
class Level:
    """One class in the chain from the registered architecture to the model that runs the layers."""

    depth: int
    attribute: str | None  # the parent's attribute holding this level (None for the top)
    class_name: str
    module: str
    file: str | None
    line: int | None
    class_mro: list[str]
    interfaces: list[str]
    interface: InterfaceReport
    runs_layers: bool  # its __init__ builds self.layers
    forward_collects_aux: bool | None  # its forward mentions aux_hidden_state(s); None if unreadable
    eagle_model_mixin: bool | None  # inherits vLLM's EagleModelMixin (0.26+); None if vLLM has none
    how_found: str = ""

    @property
    def supports_eagle3(self) -> bool:
        """vLLM's ``supports_eagle3`` verdict for this level's class."""
        return self.interface.supports_eagle3


def _source_of(obj: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def _file_line(cls: type) -> tuple[str | None, int | None]:
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:
        file = None
    try:
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        line = None
    return file, line


def _defining_init(cls: type) -> tuple[ast.FunctionDef | None, dict[str, Any]]:
    """The ``__init__`` that runs for ``cls`` (inherited ones included) as an ast node, and its globals.

    Read from the defining class's source rather than from the function object: decorators such as
    vLLM's ``support_torch_compile`` replace ``__init__`` with a wrapper that hides the original.
    """
    for klass in cls.__mro__:
        if klass is object or "__init__" not in klass.__dict__:
            continue
        env = vars(sys.modules[klass.__module__]) if klass.__module__ in sys.modules else {}
        src = _source_of(klass)
        if src is not None:
            try:
                tree = ast.parse(src)
            except SyntaxError:
                tree = None
            if tree is not None and tree.body and isinstance(tree.body[0], ast.ClassDef):
                for node in tree.body[0].body:
                    if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                        return node, env
        return _function_node(klass.__dict__["__init__"])
    return None, {}


def _function_node(fn: Any) -> tuple[ast.FunctionDef | None, dict[str, Any]]:
    fn = inspect.unwrap(fn)
    src = _source_of(fn)
    if src is None:
        return None, {}
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None, {}
    node = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    return node, getattr(fn, "__globals__", {})


def _self_assignments(init: ast.FunctionDef | None) -> dict[str, ast.expr]:
    """``self.X = <expr>`` assignments of an ``__init__`` (the last one wins, as at run time)."""
    if init is None:
        return {}
    out: dict[str, ast.expr] = {}
    for node in ast.walk(init):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            for e in elts:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out[e.attr] = value
    return out


def _resolve_registry_arch(arch: str) -> type | None:
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        return ModelRegistry._try_load_model_cls(arch)
    except Exception:  # a model module that fails to import on this host is "not resolvable" here
        return None


def _resolve_callee(
    call: ast.expr, cls: type, env: dict[str, Any], text_architectures: list[str], depth: int = 0
) -> tuple[type | None, str]:
    """The class a ``self.X = <call>`` instantiates, and how that was found."""
    if not isinstance(call, ast.Call) or depth > 2:
        return None, ""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        obj = getattr(cls, func.attr, None)
        if isinstance(obj, type):  # e.g. self.model_cls(...): a class attribute
            return obj, f"class attribute {func.attr}"
        if callable(obj):  # e.g. self._init_model(...): follow what the helper returns
            node, fenv = _function_node(obj)
            for ret in ast.walk(node) if node is not None else []:
                if isinstance(ret, ast.Return) and ret.value is not None:
                    found, how = _resolve_callee(ret.value, cls, fenv, text_architectures, depth + 1)
                    if found is not None:
                        return found, f"{func.attr}() returns {how}"
        return None, ""
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name is None:
        return None, ""
    obj = env.get(name)
    if isinstance(obj, type):
        return obj, f"instantiates {name}"
    if "registered_model" in name:
        # vLLM's init_vllm_registered_model(...): the architecture comes from an explicit
        # architectures=[...] argument, else from the sub-config passed as hf_config.
        for kw in call.keywords:
            if kw.arg == "architectures" and isinstance(kw.value, (ast.List, ast.Tuple)):
                consts = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
                if consts and isinstance(consts[0], str):
                    resolved = _resolve_registry_arch(consts[0])
                    if resolved is not None:
                        return resolved, f"{name}(architectures=[{consts[0]!r}])"
        for arch in text_architectures:
            resolved = _resolve_registry_arch(arch)
            if resolved is not None:
                return resolved, f"{name}(hf_config=text_config) -> text_config.architectures {arch!r}"
    return None, ""


def _child(cls: type, text_architectures: list[str]) -> tuple[str, type, str] | None:
    """The (attribute, class, how) of the model ``cls`` delegates to, if any."""
    init, env = _defining_init(cls)
    assigns = _self_assignments(init)
    hints = {}
    for klass in reversed(cls.__mro__):
        hints.update(getattr(klass, "__annotations__", {}) or {})
    for attr in _CHILD_ATTRS:
        if attr in assigns:
            child, how = _resolve_callee(assigns[attr], cls, env, text_architectures)
            if child is not None and child is not cls:
                return attr, child, f"__init__: self.{attr} = ... ({how})"
        hint = hints.get(attr)
        if isinstance(hint, type) and hint is not cls and issubclass(hint, _torch_module()):
            return attr, hint, f"annotation {attr}: {hint.__name__}"
    return None


@functools.lru_cache(maxsize=1)
def _torch_module() -> type:
    import torch.nn as nn

    return nn.Module


def _make_level(depth: int, attribute: str | None, cls: type, how: str) -> Level:
    interfaces = _interfaces_module()
    init, _ = _defining_init(cls)
    assigns = _self_assignments(init)
    forward = getattr(cls, "forward", None)
    fsrc = _source_of(forward) if forward is not None else None
    mixin = getattr(interfaces, "EagleModelMixin", None)
    file, line = _file_line(cls)
    return Level(
        depth=depth,
        attribute=attribute,
        class_name=cls.__name__,
        module=cls.__module__,
        file=file,
        line=line,
        class_mro=[f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__],
        interfaces=implemented_interfaces(cls),
        interface=interface_report(cls),
        runs_layers="layers" in assigns,
        forward_collects_aux=None if fsrc is None else "aux_hidden_state" in fsrc,
        eagle_model_mixin=None if mixin is None else issubclass(cls, mixin),
        how_found=how,
    )


def level_chain(cls: type, text_architectures: list[str] | None = None, max_depth: int = 5) -> list[Level]:
    """Follow wrappers from ``cls`` to the model that runs the layers, one :class:`Level` each."""
    levels = [_make_level(0, None, cls, "registry")]
    seen = {cls}
    current = cls
    for depth in range(1, max_depth):
        nxt = _child(current, text_architectures or [])
        if nxt is None:
            break
        attr, child, how = nxt
        if child in seen:
            break
        seen.add(child)
        levels.append(_make_level(depth, attr, child, how))
        current = child
    return levels


# --------------------------------------------------------------------------------------------------
# Raise sites and front-end gates, found in the installed package's source text
# --------------------------------------------------------------------------------------------------


@dataclass
class SourceSite:
    """A place in the installed vLLM's source."""

    file: str  # relative to the vllm package's parent, e.g. vllm/v1/worker/gpu_model_runner.py
    line: int
    text: str  # the quoted source (message lines joined)
    exact: bool = True  # the full refusal message (not only its stem)
    function: str | None = None


def vllm_package_dir() -> Path:
    """Folder of the installed vllm package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=4)
def _py_files(root: str) -> tuple[Path, ...]:
    return tuple(sorted(Path(root).rglob("*.py")))


def _enclosing_function(tree: ast.AST, line: int) -> str | None:
    best = None
    for node in ast.walk(tree):
        inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            node.lineno <= line <= (node.end_lineno or node.lineno)
        )
        if inside and (best is None or node.lineno > best.lineno):
            best = node
    return best.name if best else None


def find_raise_sites(pkg_dir: Path | None = None) -> list[SourceSite]:
    """Every place in the installed vLLM that raises the EAGLE-3 refusal (full message or its stem)."""
    pkg_dir = pkg_dir or vllm_package_dir()
    sites = []
    for path in _py_files(str(pkg_dir)):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if _REFUSAL_STEM not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            msg = _constant_text(node.exc)
            if _REFUSAL_STEM not in msg:
                continue
            lines = text.splitlines()[node.lineno - 1 : (node.end_lineno or node.lineno)]
            sites.append(
                SourceSite(
                    file=str(path.relative_to(pkg_dir.parent)),
                    line=node.lineno,
                    text=" ".join(s.strip() for s in lines),
                    exact=REFUSAL_MESSAGE in msg,
                    function=_enclosing_function(tree, node.lineno),
                )
            )
    # The full message first: that is the one users see.
    return sorted(sites, key=lambda s: (not s.exact, s.file, s.line))


def _constant_text(node: ast.AST) -> str:
    """Concatenated string constants inside an expression (implicit concatenation included)."""
    return "".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


@dataclass
class Gate:
    """A front-end check that refuses eagle3 unless the target's model_type matches an allow-list."""

    file: str
    line: int
    variable: str
    allowed: list[str]
    config_attr: str  # which config's model_type is tested (hf_text_config or hf_config)
    model_type: str | None  # the model_type the gate would test for this target (None: unknown)
    passes: bool | None  # None when the model_type is unknown
    text: str = ""
    # The verdict for every model_type the target carries (top level and text_config), for the record.
    by_model_type: dict[str, bool] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def find_model_type_gates(pkg_dir: Path | None = None) -> list[tuple[SourceSite, str, list[str], str]]:
    """Allow-lists of model_type substrings that guard eagle3 in vllm/config/speculative.py.

    Found structurally: a list of string constants that a comprehension iterates while testing
    ``... in <config>.model_type``, inside a function that also names "eagle3".
    Returns (site, variable, allowed, config attribute) tuples.
    """
    pkg_dir = pkg_dir or vllm_package_dir()
    candidates = [pkg_dir / "config" / "speculative.py", pkg_dir / "config.py"]
    out = []
    for path in candidates:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(text)
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if "eagle3" not in {n.value for n in ast.walk(func) if isinstance(n, ast.Constant)}:
                continue
            lists: dict[str, tuple[int, list[str]]] = {}
            for node in ast.walk(func):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, (ast.List, ast.Tuple, ast.Set))
                    and node.value.elts
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts)
                ):
                    lists[node.targets[0].id] = (node.lineno, [e.value for e in node.value.elts])
            for comp in ast.walk(func):
                if not isinstance(comp, (ast.GeneratorExp, ast.ListComp)):
                    continue
                gen = comp.generators[0]
                if not (isinstance(gen.iter, ast.Name) and gen.iter.id in lists):
                    continue
                attr_chain = [a.attr for a in ast.walk(comp.elt) if isinstance(a, ast.Attribute)]
                if "model_type" not in attr_chain:
                    continue
                config_attr = next((a for a in attr_chain if a.startswith("hf_")), "hf_config")
                lineno, allowed = lists[gen.iter.id]
                site = SourceSite(
                    file=str(path.relative_to(pkg_dir.parent)),
                    line=lineno,
                    text=text.splitlines()[lineno - 1].strip(),
                    function=func.name,
                )
                out.append((site, gen.iter.id, allowed, config_attr))
    return out


def evaluate_gates(info: TargetInfo, pkg_dir: Path | None = None) -> list[Gate]:
    """Apply each installed allow-list gate to this target's model_type."""
    gates = []
    for site, var, allowed, config_attr in find_model_type_gates(pkg_dir):
        mt = info.text_model_type if "text" in config_attr else info.model_type
        passes = None if mt is None else any(a in mt for a in allowed)
        every = {m: any(a in m for a in allowed) for m in (info.model_type, info.text_model_type) if m}
        gates.append(Gate(site.file, site.line, var, allowed, config_attr, mt, passes, site.text, every))
    return gates


# --------------------------------------------------------------------------------------------------
# Aux layer ids
# --------------------------------------------------------------------------------------------------


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default aux ids when the drafter config gives none: (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def aux_id_problems(ids: list[int], num_layers: int | None) -> list[str]:
    """Problems with aux ids in vLLM's convention (input of layer k; k == L is the final state)."""
    problems = []
    if len(set(ids)) < len(ids):
        problems.append(
            f"ids {ids} collapse to {len(set(ids))} distinct layers: the drafter's fc expects "
            f"{len(ids)} states and fails with a shape error"
        )
    if any(i <= 0 for i in ids):
        problems.append(f"ids {ids} include {min(ids)}: id 0 has no residual stream in vLLM (crash)")
    if num_layers is not None and any(i > num_layers for i in ids):
        problems.append(f"ids {ids} exceed the target's {num_layers} layers (max id {num_layers})")
    if list(ids) != sorted(ids):
        problems.append(f"ids {ids} are not ascending: vLLM returns states in layer order, not in this order")
    return problems


@dataclass
class AuxIds:
    """The aux layer ids vLLM would use for a target, where they came from, and what is wrong with them."""

    ids: list[int] | None
    source: str  # "drafter config (top level)", "drafter config (eagle_config)", "default rule", "unknown"
    num_layers: int | None
    problems: list[str]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def drafter_aux_ids(drafter_cfg: dict[str, Any]) -> tuple[list[int] | None, str]:
    """The aux ids a drafter config carries and where (top level wins, as vLLM's runners read it)."""
    ids = drafter_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids], "drafter config (top level)"
    nested = (drafter_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) for i in nested], "drafter config (eagle_config)"
    return None, "default rule"


def resolve_aux_ids(num_layers: int | None, drafter_config: str | Path | None = None) -> AuxIds:
    """The aux ids vLLM would use for this target (drafter's, or the default rule), with problems."""
    ids: list[int] | None = None
    source = "default rule"
    if drafter_config is not None:
        cfg, _ = read_json_config(drafter_config)
        ids, source = drafter_aux_ids(cfg)
    if ids is None:
        if num_layers is None:
            return AuxIds(None, "unknown (layer count unknown: give a config.json)", None, [])
        ids = default_aux_layer_ids(num_layers)
    return AuxIds(ids, source, num_layers, aux_id_problems(ids, num_layers))


# --------------------------------------------------------------------------------------------------
# The diagnosis
# --------------------------------------------------------------------------------------------------


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
    family: bool
    verdict: str
    reasons: list[str]
    plan: list[PlanStep]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (levels include their interface reports)."""
        return json.loads(json.dumps(asdict(self), default=str))


def _family_class(cls: type) -> type | None:
    """The DeepSeek-V2-family base in ``cls``'s MRO (where the patch puts the members), if any."""
    return next((k for k in cls.__mro__ if k.__name__ == FAMILY_CAUSAL_LM), None)


def diagnose(target: str | Path, drafter_config: str | Path | None = None) -> Diagnosis:
    """Diagnose EAGLE-3 support for ``target`` (architecture name, config.json or folder) on the installed vLLM.

    No GPU and no weights: the class is resolved through vLLM's registry and inspected.
    """
    t0 = time.perf_counter()
    info = target_info(target)
    vllm = _import_vllm()

    members = eagle3_protocol_members()
    raise_sites = find_raise_sites()
    gates = evaluate_gates(info)
    aux = resolve_aux_ids(info.num_hidden_layers, drafter_config)
    version = getattr(vllm, "__version__", "unknown")

    def done(**kw: Any) -> Diagnosis:
        return Diagnosis(
            target=str(target), vllm_version=version, info=info, protocol_members=members,
            raise_sites=raise_sites, gates=gates, aux=aux, seconds=round(time.perf_counter() - t0, 2), **kw,
        )

    from vllm.model_executor.models.registry import ModelRegistry

    if info.architecture not in ModelRegistry.get_supported_archs():
        return done(
            resolved=False, levels=[], family=False, verdict="unsupported", plan=[],
            reasons=[f"architecture {info.architecture!r} is not in vLLM {version}'s model registry"],
        )
    cls = _resolve_registry_arch(info.architecture)
    if cls is None:
        return done(
            resolved=False, levels=[], family=False, verdict="unsupported", plan=[],
            reasons=[f"vLLM {version} lists {info.architecture!r} but its class failed to import here"],
        )
    levels = level_chain(cls, info.text_architectures)
    family = any(_family_class(_load(lv)) is not None for lv in levels) or any(
        lv.class_name == FAMILY_INNER_MODEL for lv in levels
    )
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
    if top.supports_eagle3 and inner.forward_collects_aux is not False and not refusing:
        verdict = "native"
    elif family:
        verdict = "patchable"
    else:
        verdict = "unsupported"
        reasons.append(
            f"not a DeepSeek-V2-family model (no {FAMILY_CAUSAL_LM} in the chain "
            f"{' -> '.join(lv.class_name for lv in levels)}): our patch does not apply"
        )
    plan = _plan(levels, refusing + unknown_gates) if verdict == "patchable" else []
    if aux.problems:
        reasons.extend(f"aux ids: {p}" for p in aux.problems)
    return done(resolved=True, levels=levels, family=family, verdict=verdict, reasons=reasons, plan=plan)


def _load(level: Level) -> type:
    return getattr(sys.modules[level.module], level.class_name)


def _plan(levels: list[Level], gates: list[Gate]) -> list[PlanStep]:
    steps: list[PlanStep] = []
    done: set[str] = set()
    inner = levels[-1]
    for lv in levels[:-1]:
        if lv.supports_eagle3:
            continue
        fam = _family_class(_load(lv))
        name = fam.__name__ if fam is not None else lv.class_name
        if name in done:
            continue
        done.add(name)
        via = f" (base of {lv.class_name})" if name != lv.class_name else ""
        child = levels[lv.depth + 1]
        deleg = f"self.{child.attribute}" if child.attribute else "its inner model"
        steps.append(
            PlanStep(
                "add_interface",
                name,
                f"add SupportsEagle3 to the bases of {name}{via} and define "
                f"{', '.join(lv.interface.members_missing) or 'its members'}; the layer setters/getters "
                f"delegate to {deleg}",
            )
        )
    if inner.forward_collects_aux is False:
        steps.append(
            PlanStep(
                "replace_forward",
                inner.class_name,
                f"replace {inner.class_name}.forward with one that returns (hidden_states, [aux...]) where aux "
                "is hidden_states + residual at the input of each requested layer (id == num_layers: the "
                "final pre-norm state), and give it aux_hidden_state_layers = ()",
            )
        )
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
        out.append(f"    ! {p}")
    out.append("  why:")
    out.extend(f"    - {r}" for r in d.reasons)
    if d.plan:
        out.append("  patch plan:")
        out.extend(f"    {n}. [{s.kind}] {s.target}: {s.detail}" for n, s in enumerate(d.plan, 1))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Registry-wide table (source-level, no imports: importing every model module is slow)
# --------------------------------------------------------------------------------------------------


@dataclass
class RegistryRow:
    """One registered generative architecture: native EAGLE-3 support, and whether our patch applies."""

    architecture: str
    kind: str  # "text" or "multimodal"
    module: str
    class_name: str
    native_eagle3: bool | None  # None when the source could not be analysed
    patchable: bool  # DeepSeek-V2 family (subclass, or a wrapper whose language model is one)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


_CLASS_RE = re.compile(r"^class\s+(\w+)\s*(?:\((.*?)\))?\s*:", re.M | re.S)
_FROM_RE = re.compile(r"^[ \t]*from\s+(\.*[\w.]*)\s+import\s+(\([^)]*\)|[^\n]+)", re.M)
_CHILD_RE = re.compile(
    r"self\.(" + "|".join(_CHILD_ATTRS) + r")\s*(?::[^=\n]+)?=\s*([\w.]+)\s*\((.*?)\)\s*$", re.M | re.S
)


class _SourceIndex:
    """Classes, bases, imports and wrapper children of vLLM model modules, from their source text.

    Regular expressions over vLLM's (black/ruff-formatted) sources instead of ``ast``: parsing and
    walking ~250 model files takes about a minute on a busy CPU host, scanning them a second or two.
    """

    def __init__(self) -> None:
        self.root = vllm_package_dir().parent
        self.modules: dict[str, tuple[dict[str, tuple[list[str], str]], dict[str, tuple[str, str]]] | None] = {}

    def _path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def load(self, module: str) -> tuple[dict[str, tuple[list[str], str]], dict[str, tuple[str, str]]] | None:
        """(class name -> (base names, class body text), imported name -> (module, name)) of a module."""
        if module in self.modules:
            return self.modules[module]
        path = self._path(module)
        result = None
        if path is not None:
            text = path.read_text(encoding="utf-8", errors="replace")
            classes: dict[str, tuple[list[str], str]] = {}
            matches = list(_CLASS_RE.finditer(text))
            for i, m in enumerate(matches):
                body = text[m.end() : matches[i + 1].start() if i + 1 < len(matches) else len(text)]
                bases = []
                for b in re.sub(r"\[.*?\]", "", m.group(2) or "", flags=re.S).split(","):
                    b = b.strip()
                    if b and "=" not in b:
                        bases.append(b.rsplit(".", 1)[-1])
                classes[m.group(1)] = (bases, body)
            imports: dict[str, tuple[str, str]] = {}
            pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for m in _FROM_RE.finditer(text):
                src, names = m.group(1), m.group(2).strip("() \n")
                level = len(src) - len(src.lstrip("."))
                if level:
                    parts = pkg.split(".")
                    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
                    rest = src.lstrip(".")
                    src = ".".join(parts + ([rest] if rest else []))
                for item in re.sub(r"#[^\n]*", "", names).split(","):
                    bits = item.split()
                    if not bits:
                        continue
                    alias = bits[2] if len(bits) == 3 and bits[1] == "as" else bits[0]
                    imports[alias] = (src, bits[0])
            result = (classes, imports)
        self.modules[module] = result
        return result

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """Where class ``name`` seen from ``module`` is defined: (module, class name)."""
        loaded = self.load(module)
        if loaded is None or depth > 6:
            return None
        classes, imports = loaded
        if name in classes:
            return module, name
        if name in imports:
            src, orig = imports[name]
            return self.resolve(src, orig, depth + 1)
        return None

    def ancestors(self, module: str, name: str) -> list[tuple[str, str]]:
        """The class and its (source-resolvable) ancestors, breadth first."""
        out, todo = [], [(module, name)]
        while todo:
            mod, cname = todo.pop(0)
            if (mod, cname) in out:
                continue
            out.append((mod, cname))
            loaded = self.load(mod)
            if loaded is None or cname not in loaded[0]:
                continue
            for bname in loaded[0][cname][0]:
                r = self.resolve(mod, bname)
                if r is not None:
                    todo.append(r)
        return out

    def child_archs(self, module: str, name: str) -> list[str]:
        """What a wrapper builds for language_model/model: registry architectures or ``module:Class``."""
        found = []
        for mod, cname in self.ancestors(module, name):
            loaded = self.load(mod)
            if loaded is None or cname not in loaded[0]:
                continue
            for m in _CHILD_RE.finditer(loaded[0][cname][1]):
                func, args = m.group(2).rsplit(".", 1)[-1], m.group(3)
                if "registered_model" in func:
                    arch = re.search(r"architectures\s*=\s*\[\s*[\"']([\w.]+)[\"']", args)
                    if arch:
                        found.append(arch.group(1))
                else:
                    found.append(f"{mod}:{func}")
        return found


def _text_generation_archs() -> list[tuple[str, str]]:
    """(architecture, kind) for the installed registry's text-generation and multimodal generators."""
    _import_vllm()
    from vllm.model_executor.models import registry

    out = []
    for var, kind in (("_TEXT_GENERATION_MODELS", "text"), ("_MULTIMODAL_MODELS", "multimodal")):
        out += [(arch, kind) for arch in getattr(registry, var, {})]
    return out


def registry_table(show_progress: bool = False) -> list[RegistryRow]:
    """Every text-generation architecture of the installed vLLM: native EAGLE-3, and whether our patch applies.

    Source-level (``ast``): following base classes through imports answers in seconds, where importing
    every model module takes minutes on a CPU host. Structural-only Protocol matches (a class defining
    every member without naming SupportsEagle3) are not seen; vLLM's models name the Protocol.
    """
    from vllm.model_executor.models.registry import ModelRegistry

    idx = _SourceIndex()
    iface_mod = "vllm.model_executor.models.interfaces"
    rows = []
    archs = _text_generation_archs()
    if show_progress:
        from tqdm.auto import tqdm

        archs = tqdm(archs, desc="registry")
    for arch, kind in archs:
        entry = ModelRegistry.models.get(arch)
        if entry is None:
            continue
        module = getattr(entry, "module_name", None)
        cname = getattr(entry, "class_name", None)
        if module is None:  # registered as a class object (out-of-tree plugin)
            mc = getattr(entry, "model_cls", None)
            module, cname = getattr(mc, "__module__", "?"), getattr(mc, "__name__", "?")
        where = idx.resolve(module, cname)  # packages re-export classes from submodules
        if where is None:
            rows.append(RegistryRow(arch, kind, module, cname, None, False, "source not analysable"))
            continue
        anc = idx.ancestors(*where)
        native = (iface_mod, "SupportsEagle3") in anc
        fam = any(c == FAMILY_CAUSAL_LM for _, c in anc)
        note = "DeepSeek-V2 family" if fam else ""
        if not fam:
            for child in idx.child_archs(module, cname):
                if ":" in child:
                    cmod, ccls = child.split(":", 1)
                    r = idx.resolve(cmod, ccls)
                    chain = idx.ancestors(*r) if r else []
                else:
                    ce = ModelRegistry.models.get(child)
                    cm, cc = getattr(ce, "module_name", None), getattr(ce, "class_name", None)
                    chain = idx.ancestors(cm, cc) if cm else []
                if any(c == FAMILY_CAUSAL_LM for _, c in chain):
                    fam, note = True, f"wrapper around {chain[0][1]}"
                    break
        rows.append(RegistryRow(arch, kind, module, cname, native, fam, note))
    return rows
