"""Import rules of DESIGN.md's module map: nothing imports a layer above it; no import cycle, among files or among
the table's rows; our modules import each other at module level, except where a comment ``# lazy: <why>`` on the
import (or on the line above it) says why it must wait for the call (a lazy torch or vLLM import is the point),
and the engines and aux-state packages and target_loading never lazily; only vllm_compat reaches vLLM's
internals; the config layer stays free of torch and vLLM, and so do the modules whose lazy imports keep them so.

The layer table is read from DESIGN.md itself, so the documentation cannot drift from what is checked.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lib" / "eagle3lab"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|")
# vLLM's public API: allowed outside vllm_compat (in layers >= 3). Everything else under vllm. is internal.
PUBLIC_VLLM = {"vllm", "vllm.inputs", "vllm.sampling_params", "vllm.outputs"}
# A function-level import of our own modules hides an arrow: it is allowed only with a comment that says why it
# must stay lazy, ``# lazy: <why>``, on the import's own lines or on the line just above it.
LAZY_MARK = re.compile(r"\blazy:\s*\S")
# Rows whose modules import our own modules only at module level, with or without a lazy: comment.
NO_LAZY_OWN_IMPORTS = ("engines", "aux_states", "target_loading")
# Modules that stay free of torch and vLLM at import (the CLI's --help, the plugin every vLLM process loads,
# synthetic's prompt files): their lazy: imports are what keeps them so.
LIGHT_MODULES = ("params", "cli", "plugin", "synthetic")


def layer_table(text: str | None = None) -> dict[str, int]:
    """module -> layer, from the "Module map" table of DESIGN.md."""
    text = text if text is not None else (ROOT / "DESIGN.md").read_text()
    return {m.group(2): int(m.group(1)) for line in text.splitlines() if (m := ROW.match(line))}


def file_module(path: Path) -> str:
    """A file's dotted name under lib/eagle3lab: ``engines.base``, ``diagnose`` for its ``__init__``."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def row_of(dotted: str, table: dict[str, int]) -> str:
    """The table's row for a dotted module name under eagle3lab: the longest prefix with a row (``engines.base``
    has its own row; ``diagnose.verdict`` is the ``diagnose`` row), else its top-level name."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return ".".join(parts[:i])
    return parts[0]


def module_of(path: Path, table: dict[str, int] | None = None) -> str:
    """The table's name for a file: its own row where it has one, else its package's or its top-level module's."""
    return row_of(file_module(path), table if table is not None else {})


def _in_functions(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a function body."""
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside |= {id(n) for n in ast.walk(fn) if n is not fn}
    return inside


def imports(path: Path, with_scope: bool = False) -> list[tuple[int, str]] | list[tuple[int, str, bool]]:
    """(line, dotted module) for every import in a file, including imports inside functions and
    ``from eagle3lab[.x] import y`` (-> also ``eagle3lab[.x].y``, which may be a module) and
    ``importlib.import_module("...")`` literals. ``with_scope`` adds whether the import sits inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    inside = _in_functions(tree)
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module.split(".")[0] == "eagle3lab":
                names += [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        out += [(node.lineno, n, id(node) in inside) if with_scope else (node.lineno, n) for n in names]
    return out


def own_imports(path: Path, modules: Iterable[str]) -> list[tuple[int, str, bool]]:
    """(line, our module, inside a function) for each import of one of our files' modules (``modules``: dotted
    names under eagle3lab) by ``path``; ``from eagle3lab.x import name`` counts as importing ``x`` unless
    ``x.name`` is itself a module."""
    known = set(modules)
    found: dict[tuple[int, bool], set[str]] = {}
    for line, name, lazy in imports(path, with_scope=True):
        parts = name.split(".")
        if parts[0] != "eagle3lab" or len(parts) < 2:
            continue
        mod = ".".join(parts[1:])
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod:
            found.setdefault((line, lazy), set()).add(mod)
    out = []
    for (line, lazy), mods in found.items():
        # the deepest modules of one statement: "from eagle3lab.engines import base" imports engines.base
        out += [(line, m, lazy) for m in mods if not any(o.startswith(m + ".") for o in mods)]
    return sorted(out)


def lazy_marked(path: Path) -> set[int]:
    """First lines of the imports in ``path`` (statements and ``import_module`` calls) that carry a ``lazy:``
    comment with a reason, on one of their lines or on the line just above."""
    src = path.read_text()
    marks = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.COMMENT and LAZY_MARK.search(tok.string)}
    return {node.lineno for node in ast.walk(ast.parse(src, str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call))
            and marks & set(range(node.lineno - 1, (node.end_lineno or node.lineno) + 1))}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each one circle or several), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has tens of nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def import_graphs(table: dict[str, int], files: list[Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Our imports as two graphs, counting imports inside functions: file -> file (dotted names) and row -> row
    (the table's rows; a row's imports of itself left out)."""
    modules = {file_module(p): p for p in files}
    by_file: dict[str, set[str]] = {m: set() for m in modules}
    by_row: dict[str, set[str]] = {}
    for me, path in modules.items():
        for _, other, _ in own_imports(path, modules):
            if other == me:
                continue
            by_file[me].add(other)
            a, b = row_of(me, table), row_of(other, table)
            if a != b:
                by_row.setdefault(a, set()).add(b)
    return by_file, by_row


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def violations(table: dict[str, int], files: list[Path]) -> list[str]:
    """Every broken rule, one line each (file:line and why)."""
    problems = []
    for path in files:
        me = module_of(path, table)
        if me not in table:
            problems.append(f"{_shown(path)}: module {me!r} has no row in DESIGN.md's module map")
            continue
        for line, name in imports(path):
            where = f"{_shown(path)}:{line}"
            parts = name.split(".")
            if parts[0] == "eagle3lab" and len(parts) > 1:
                other = row_of(".".join(parts[1:]), table)
                if other != me and other in table and table[other] > table[me]:
                    problems.append(f"{where}: {me} (layer {table[me]}) imports {other} (layer {table[other]})")
            if parts[0] == "vllm" and me != "vllm_compat":
                top2 = ".".join(parts[:2])
                if top2 not in PUBLIC_VLLM or table[me] < 3:
                    problems.append(f"{where}: {me} imports vLLM's internals ({name}): go through vllm_compat")
    by_file, by_row = import_graphs(table, files)
    problems += [f"import cycle among files: {' <-> '.join(c)}" for c in cycles(by_file)]
    problems += [f"import cycle among the module map's rows: {' <-> '.join(c)}" for c in cycles(by_row)]
    modules = [file_module(p) for p in files]
    for path in files:
        strict = row_of(file_module(path), table).split(".")[0] in NO_LAZY_OWN_IMPORTS
        marked = lazy_marked(path)
        for line, other, lazy in own_imports(path, modules):
            where = f"{_shown(path)}:{line}: imports eagle3lab.{other} inside a function"
            if lazy and strict:
                problems.append(f"{where}: import it at module level (this row allows no lazy import)")
            elif lazy and line not in marked:
                problems.append(f"{where}: import it at module level, or say why it must stay lazy in a "
                                f"'# lazy: <why>' comment on the import or the line above")
    return problems


def lib_files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_design_md_has_the_module_map():
    table = layer_table()
    assert {"aux_layers", "vllm_compat", "params", "diagnose", "patch", "drafter", "cli"} <= set(table)


def test_no_module_imports_a_layer_above_it():
    problems = violations(layer_table(), lib_files())
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_broken_rule(tmp_path):
    """The checker itself: an upward import, an internal vLLM import and a module missing from the table
    are each reported (so a green run means the rules hold, not that the checker is blind)."""
    global PKG
    pkg = tmp_path / "lib" / "eagle3lab"
    pkg.mkdir(parents=True)
    (pkg / "params.py").write_text("from eagle3lab import diagnose\n")
    (pkg / "patch.py").write_text("def f():\n    from vllm.model_executor.models import registry\n")
    (pkg / "stray.py").write_text("")
    old, PKG = PKG, pkg
    try:
        found = violations(layer_table(), sorted(pkg.rglob("*.py")))
    finally:
        PKG = old
    assert any("params (layer 1) imports diagnose (layer 2)" in p for p in found), found
    assert any("patch imports vLLM's internals" in p for p in found), found
    assert any("'stray' has no row" in p for p in found), found
    assert len(found) == 3


def test_the_check_sees_a_cycle_and_a_lazy_import(tmp_path):
    """A circle through a function-level import (engines.base -> engines.factory -> engines.base) is reported
    among files and among rows, and so is the lazy import itself; a circle inside a one-row package
    (diagnose.a <-> diagnose.b) among files only."""
    global PKG
    pkg = tmp_path / "lib" / "eagle3lab"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "diagnose").mkdir()
    for f in ("__init__.py", "engines/__init__.py", "diagnose/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "engines" / "base.py").write_text("def f():\n    from eagle3lab.engines import factory\n")
    (pkg / "engines" / "factory.py").write_text("from eagle3lab.engines.base import Engine\n")
    (pkg / "diagnose" / "a.py").write_text("from eagle3lab.diagnose import b\n")
    (pkg / "diagnose" / "b.py").write_text("from eagle3lab.diagnose.a import x\n")
    old, PKG = PKG, pkg
    try:
        found = violations(layer_table(), sorted(pkg.rglob("*.py")))
    finally:
        PKG = old
    assert "import cycle among files: engines.base <-> engines.factory" in found, found
    assert "import cycle among the module map's rows: engines.base <-> engines.factory" in found, found
    assert "import cycle among files: diagnose.a <-> diagnose.b" in found, found
    assert any(p.endswith(":2: imports eagle3lab.engines.factory inside a function: import it at module level "
                          "(this row allows no lazy import)") for p in found), found
    assert len(found) == 4, found


def test_the_check_sees_an_unmarked_lazy_import(tmp_path):
    """Outside the strict rows a function-level import of ours passes only with a ``lazy:`` comment that gives a
    reason, on the import or the line above: a bare import, and a bare ``lazy:``, are each reported with their
    file and line."""
    global PKG
    pkg = tmp_path / "lib" / "eagle3lab"
    pkg.mkdir(parents=True)
    for name in ("params", "drafter", "target", "runner"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "cli.py").write_text(
        "def a():\n"
        "    from eagle3lab import params\n"  # 2: unmarked
        "def b():\n"
        "    from eagle3lab import drafter  # lazy: torch\n"  # 4: marked on the line
        "def c():\n"
        "    # lazy: torch, for the CLI's --help\n"
        "    from eagle3lab.drafter import (\n"  # 7: marked on the line above, wrapped by the formatter
        "        default_drafter_heads,\n"
        "    )\n"
        "def d():\n"
        "    from eagle3lab import target  # lazy:\n"  # 11: a marker without a reason
        "def e():\n"
        "    s = '# lazy: not a comment'\n"
        "    from eagle3lab import runner\n")  # 14: the text above is a string, not a comment
    old, PKG = PKG, pkg
    try:
        found = violations(layer_table(), sorted(pkg.rglob("*.py")))
    finally:
        PKG = old
    lines = sorted(int(p.split(":")[1]) for p in found)
    assert lines == [2, 11, 14], found
    assert found[0].endswith("cli.py:2: imports eagle3lab.params inside a function: import it at module level, "
                             "or say why it must stay lazy in a '# lazy: <why>' comment on the import or the line "
                             "above"), found


def test_the_import_graph_has_no_cycle():
    """The package itself, counted both ways (files, rows): the engine <-> serve circle of 2026-12-05 is gone."""
    by_file, by_row = import_graphs(layer_table(), lib_files())
    assert cycles(by_file) == [] and cycles(by_row) == []
    assert "engines.base" in by_file["engines.vllm_served"]  # the graph sees the package's own arrows


def imported_from(module: str, packages: tuple[str, ...]) -> str:
    """What importing ``eagle3lab.<module>`` in a fresh interpreter loads of ``packages`` (a printed sorted list)."""
    code = f"import sys, eagle3lab.{module}; print(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_modules_import_neither_torch_nor_vllm(module):
    """The config layer, and the modules whose lazy: imports are there to keep torch and vLLM out."""
    out = imported_from(module, ("torch", "vllm", "transformers"))
    assert out == "[]", out


def test_the_cli_needs_no_notebook_stack():
    """`eagle3lab diagnose` and `patch --check` run in a bare vLLM venv (the legacy 0.17 one installs eagle3lab
    without its dependencies): the CLI module imports neither plotly nor papermill (a CI run failed on that)."""
    out = imported_from("cli", ("plotly", "papermill", "nbformat"))
    assert out == "[]", out
