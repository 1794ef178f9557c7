"""Walking wrappers down from the registered class to the model that runs the decoder layers.

Each level is found by reading the installed classes: the attribute an ``__init__`` assigns
(``self.language_model = init_vllm_registered_model(...)``, ``self.model = self.model_cls(...)``),
resolved to the class it builds. Read from source (``ast``) because decorators such as vLLM's
``support_torch_compile`` hide the original ``__init__``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.protocol import InterfaceReport, implemented_interfaces, interface_report

# Attributes that wrappers conventionally use for the model they delegate to, in preference order.
_CHILD_ATTRS = ("language_model", "model", "text_model", "llm", "lm")


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


# Memoised per class: the registry table asks for the same classes' __init__ thousands of times (every
# architecture's levels, decoder layers and the keyword search through their MROs), and parsing their sources
# again each time made 01's registry table take 3 minutes on the 2-core EPYC (2026-12-07 profile: 93 s in
# compile, 67 s in ast.parse). The trees are only read, never changed.
@functools.cache
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
                    resolved = vllm_compat.try_load_model_class(consts[0])
                    if resolved is not None:
                        return resolved, f"{name}(architectures=[{consts[0]!r}])"
        for arch in text_architectures:
            resolved = vllm_compat.try_load_model_class(arch)
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
    interfaces = vllm_compat.interfaces()
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
        # Our rewritten forward has no source file; it collects by construction.
        forward_collects_aux=True if getattr(forward, "__eagle3lab__", False) else (
            None if fsrc is None else "aux_hidden_state" in fsrc),
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

