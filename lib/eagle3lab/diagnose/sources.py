"""Where the installed vLLM raises the EAGLE-3 refusal, and its front-end gate, read from its source files."""

from __future__ import annotations

import ast
import functools
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.target_info import TargetInfo


@dataclass
class SourceSite:
    """A place in the installed vLLM's source."""

    file: str  # relative to the vllm package's parent, e.g. vllm/v1/worker/gpu_model_runner.py
    line: int
    text: str  # the quoted source (message lines joined)
    exact: bool = True  # the full refusal message (not only its stem)
    function: str | None = None



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
    pkg_dir = pkg_dir or vllm_compat.vllm_package_dir()
    # Scanned once per process and folder (half a second of parsing; the registry-wide checks diagnose every
    # architecture), copied so that a caller's edits stay its own.
    return [replace(s) for s in _raise_sites(Path(pkg_dir))]


@functools.lru_cache(maxsize=4)
def _raise_sites(pkg_dir: Path) -> tuple[SourceSite, ...]:
    sites = []
    for path in _py_files(str(pkg_dir)):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if vllm_compat.REFUSAL_STEM not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            msg = _constant_text(node.exc)
            if vllm_compat.REFUSAL_STEM not in msg:
                continue
            lines = text.splitlines()[node.lineno - 1 : (node.end_lineno or node.lineno)]
            sites.append(
                SourceSite(
                    file=str(path.relative_to(pkg_dir.parent)),
                    line=node.lineno,
                    text=" ".join(s.strip() for s in lines),
                    exact=vllm_compat.REFUSAL_MESSAGE in msg,
                    function=_enclosing_function(tree, node.lineno),
                )
            )
    # The full message first: that is the one users see.
    return tuple(sorted(sites, key=lambda s: (not s.exact, s.file, s.line)))


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



def evaluate_gates(info: TargetInfo) -> list[Gate]:
    """Apply each installed allow-list gate (:func:`eagle3lab.vllm_compat.frontend_gates`) to this target."""
    gates = []
    for g in vllm_compat.frontend_gates():
        allowed = list(g.allowed)
        mt = info.text_model_type if "text" in g.config_attr else info.model_type
        passes = None if mt is None else any(a in mt for a in allowed)
        every = {m: any(a in m for a in allowed) for m in (info.model_type, info.text_model_type) if m}
        gates.append(Gate(g.file, g.line, g.variable, allowed, g.config_attr, mt, passes, g.text, every))
    return gates
