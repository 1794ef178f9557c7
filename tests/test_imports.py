"""Import rules of DESIGN.md's module map: nothing imports a layer above it; only vllm_compat reaches vLLM's
internals; the config layer stays free of torch and vLLM.

The layer table is read from DESIGN.md itself, so the documentation cannot drift from what is checked.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lib" / "eagle3lab"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`\s*\|")
# vLLM's public API: allowed outside vllm_compat (in layers >= 3). Everything else under vllm. is internal.
PUBLIC_VLLM = {"vllm", "vllm.inputs", "vllm.sampling_params", "vllm.outputs"}


def layer_table(text: str | None = None) -> dict[str, int]:
    """module -> layer, from the "Module map" table of DESIGN.md."""
    text = text if text is not None else (ROOT / "DESIGN.md").read_text()
    return {m.group(2): int(m.group(1)) for line in text.splitlines() if (m := ROW.match(line))}


def module_of(path: Path) -> str:
    """The table's name for a file: its top-level module or package under lib/eagle3lab."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in a file, including imports inside functions and
    ``from eagle3lab import x`` (-> ``eagle3lab.x``) and ``importlib.import_module("...")`` literals."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == "eagle3lab"]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def violations(table: dict[str, int], files: list[Path]) -> list[str]:
    """Every broken rule, one line each (file:line and why)."""
    problems = []
    for path in files:
        me = module_of(path)
        if me not in table:
            problems.append(f"{_shown(path)}: module {me!r} has no row in DESIGN.md's module map")
            continue
        for line, name in imports(path):
            where = f"{_shown(path)}:{line}"
            parts = name.split(".")
            if parts[0] == "eagle3lab" and len(parts) > 1:
                other = parts[1]
                if other != me and other in table and table[other] > table[me]:
                    problems.append(f"{where}: {me} (layer {table[me]}) imports {other} (layer {table[other]})")
            if parts[0] == "vllm" and me != "vllm_compat":
                top2 = ".".join(parts[:2])
                if top2 not in PUBLIC_VLLM or table[me] < 3:
                    problems.append(f"{where}: {me} imports vLLM's internals ({name}): go through vllm_compat")
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


def test_config_layer_imports_neither_torch_nor_vllm():
    code = ("import sys, eagle3lab.params; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
