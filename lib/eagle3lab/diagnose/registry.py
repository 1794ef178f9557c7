"""Every text-generation architecture of the installed vLLM: native EAGLE-3 support, and whether our patch applies.

Source-level, no imports: importing every model module takes minutes on a CPU host.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.levels import _CHILD_ATTRS
from eagle3lab.diagnose.verdict import FAMILY_CAUSAL_LM


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
        self.root = vllm_compat.vllm_package_dir().parent
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


def registry_table(show_progress: bool = False) -> list[RegistryRow]:
    """Every text-generation architecture of the installed vLLM: native EAGLE-3, and whether our patch applies.

    Source-level (``ast``): following base classes through imports answers in seconds, where importing
    every model module takes minutes on a CPU host. Structural-only Protocol matches (a class defining
    every member without naming SupportsEagle3) are not seen; vLLM's models name the Protocol.
    """
    registry = vllm_compat.model_registry()
    idx = _SourceIndex()
    iface_mod = "vllm.model_executor.models.interfaces"
    rows = []
    archs = vllm_compat.registry_architectures()
    if show_progress:
        from eagle3lab.progress import progress

        archs = progress(archs, desc="registry")
    for arch, kind in archs:
        entry = registry.models.get(arch)
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
                    ce = registry.models.get(child)
                    cm, cc = getattr(ce, "module_name", None), getattr(ce, "class_name", None)
                    chain = idx.ancestors(cm, cc) if cm else []
                if any(c == FAMILY_CAUSAL_LM for _, c in chain):
                    fam, note = True, f"wrapper around {chain[0][1]}"
                    break
        rows.append(RegistryRow(arch, kind, module, cname, native, fam, note))
    return rows


# Statuses, one per row: a DeepSeek-V2-family model that is already native counts as "native" (our patch
# would apply to it too, but it is not needed); "patch needed" is family and not native.
STATUSES = ("native", "patch needed", "neither")


def registry_status(row: RegistryRow) -> str:
    """One of :data:`STATUSES` for a row (rows whose source could not be analysed count as "neither")."""
    if row.native_eagle3:
        return "native"
    return "patch needed" if row.patchable else "neither"


@dataclass
class RegistryCounts:
    """Counts of one registry kind ("text", "multimodal") or of all rows ("all")."""

    kind: str
    architectures: int
    native: int  # native EAGLE-3 on the installed vLLM
    patchable: int  # DeepSeek-V2 family: our patch applies (native or not)
    patch_needed: int  # DeepSeek-V2 family and not native
    neither: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def registry_counts(rows: list[RegistryRow]) -> list[RegistryCounts]:
    """Counts per kind, then "all"; ``native + patch_needed + neither == architectures`` in every row."""
    kinds = sorted({r.kind for r in rows})
    out = []
    for kind in (*kinds, "all"):
        sel = [r for r in rows if kind in ("all", r.kind)]
        status = [registry_status(r) for r in sel]
        out.append(RegistryCounts(
            kind=kind, architectures=len(sel), native=status.count("native"),
            patchable=sum(r.patchable for r in sel), patch_needed=status.count("patch needed"),
            neither=status.count("neither"),
        ))
    return out


def write_registry_csv(rows: list[RegistryRow], path: str | Path) -> Path:
    """Every row (with its module and status) as CSV, for the rows a page cannot show."""
    import csv

    out = Path(path)
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["architecture", "kind", "module", "class_name", "native_eagle3", "patchable", "status", "note"])
        for r in rows:
            writer.writerow([r.architecture, r.kind, r.module, r.class_name, r.native_eagle3, r.patchable,
                             registry_status(r), r.note])
    return out
