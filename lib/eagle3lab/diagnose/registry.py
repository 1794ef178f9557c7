"""Every text-generation and multimodal architecture of the installed vLLM, each with the patch plan's verdict.

The verdict of each row is :func:`eagle3lab.diagnose.plan.plan_for` on the class vLLM's registry loads: the
same plan ``diagnose`` prints and ``patch`` executes, so the table, a diagnosis and ``patch --check`` cannot
disagree (``tests/vllm/test_registry_agreement.py`` checks every row by applying the patch). Loading every
model class takes seconds once vLLM is imported; classes whose module does not import on this host are
reported with the import error.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.levels import level_chain
from eagle3lab.diagnose.plan import plan_for
from eagle3lab.progress import progress

NOT_LOADABLE = "not loadable here"
# One status per row; they partition the registry.
STATUSES = ("native", "patchable", "not patchable", NOT_LOADABLE)


@dataclass
class RegistryRow:
    """One registered architecture: its status and the plan's one-line reason."""

    architecture: str
    kind: str  # "text" or "multimodal"
    module: str
    class_name: str
    status: str  # one of STATUSES
    reason: str  # the plan's reason (what the patch does, or why it does not), or the import error
    levels: str = ""  # the class chain, e.g. "KimiVLForConditionalGeneration -> DeepseekV2ForCausalLM -> ..."

    @property
    def native_eagle3(self) -> bool:
        return self.status == "native"

    @property
    def patchable(self) -> bool:
        """Our patch makes vLLM accept it (it needs it: native rows are not counted)."""
        return self.status == "patchable"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def registry_row(arch: str, kind: str) -> RegistryRow:
    """The row of one architecture (loads its class)."""
    entry = vllm_compat.model_registry().models.get(arch)
    module = getattr(entry, "module_name", None) or "?"
    cname = getattr(entry, "class_name", None) or "?"
    try:
        cls = vllm_compat.load_model_class(arch)
    except ValueError as exc:
        return RegistryRow(arch, kind, module, cname, NOT_LOADABLE, str(exc))
    try:
        levels = level_chain(cls, [])
        plan = plan_for(cls, levels=levels)
    except Exception as exc:  # noqa: BLE001 - a class we cannot read is reported, not guessed
        return RegistryRow(arch, kind, module, cname, "not patchable", f"its classes could not be read: {exc}")
    status = {"native": "native", "patchable": "patchable"}.get(plan.verdict, "not patchable")
    return RegistryRow(arch, kind, module, cname, status, plan.reason, " -> ".join(plan.levels))


@contextlib.contextmanager
def _registry_log_quiet() -> Iterator[None]:
    """Loading every model logs noise: vLLM's registry logs each failed import with its traceback (the row names
    the error instead), and transformers warns about image processors it falls back from."""
    logs = [logging.getLogger(name) for name in ("vllm.model_executor.models.registry", "transformers")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


def registry_table(show_progress: bool = False) -> list[RegistryRow]:
    """Every text-generation and multimodal architecture of the installed vLLM, one :class:`RegistryRow` each."""
    archs = vllm_compat.registry_architectures()
    if show_progress:
        archs = progress(archs, desc="registry")
    with _registry_log_quiet():
        return [registry_row(arch, kind) for arch, kind in archs]


def registry_status(row: RegistryRow) -> str:
    """The row's status (one of :data:`STATUSES`)."""
    return row.status


@dataclass
class RegistryCounts:
    """Counts of one registry kind ("text", "multimodal") or of all rows ("all")."""

    kind: str
    architectures: int
    native: int
    patchable: int  # not native; our patch makes vLLM accept it
    not_patchable: int
    not_loadable: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def registry_counts(rows: list[RegistryRow]) -> list[RegistryCounts]:
    """Counts per kind, then "all"; the four statuses add up to ``architectures`` in every row."""
    out = []
    for kind in (*sorted({r.kind for r in rows}), "all"):
        status = Counter(r.status for r in rows if kind in ("all", r.kind))
        out.append(RegistryCounts(kind, sum(status.values()), status["native"], status["patchable"],
                                  status["not patchable"], status[NOT_LOADABLE]))
    return out


# Reasons differ in class names and source text; these patterns group them by cause.
_REASON_GROUPS = (
    ("hybrid or attention-free model (recurrent state)", re.compile(r"hybrid model|attention-free")),
    ("decoder layers' residual use unknown", re.compile(r"aux states would be a guess")),
    ("several attention sublayers per layer", re.compile(r"several attention")),
    ("index loop over self.layers[i]", re.compile(r"indexes self\.layers")),
    ("no loop over self.layers in forward", re.compile(r"no loop over self\.layers")),
    ("no self.layers in the class chain", re.compile(r"builds self\.layers")),
    ("layers run several times per forward", re.compile(r"inside another loop")),
    ("layer loop of another form", re.compile(r"layer loop|layer call|loops over self\.layers")),
    ("module does not import here", re.compile(r"failed to import|cannot load")),
)


def reason_group(row: RegistryRow) -> str:
    """The cause of a row that is not native or patchable, in a few words."""
    for name, pattern in _REASON_GROUPS:
        if pattern.search(row.reason):
            return name
    return "other"


def reason_counts(rows: list[RegistryRow]) -> list[dict[str, Any]]:
    """Rows that are neither native nor patchable, grouped by cause, with examples (most frequent first)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.status in ("not patchable", NOT_LOADABLE):
            groups.setdefault(reason_group(r), []).append(r.architecture)
    return [{"cause": k, "architectures": len(v), "examples": ", ".join(v[:4]) + (" ..." if len(v) > 4 else "")}
            for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def _import_error_of(row: RegistryRow) -> str:
    """The import error a not-loadable row names (``ModuleNotFoundError: No module named 'torchvision'``)."""
    for pattern in (r" raised (.+)$", r"cannot load its class \((.+)\)$", r"failed to import here: (.+)$"):
        m = re.search(pattern, row.reason, re.DOTALL)
        if m:
            return m.group(1).strip()
    return row.reason


def import_error_counts(rows: list[RegistryRow]) -> list[dict[str, Any]]:
    """The rows not loadable here, grouped by the import error that stopped them (most frequent first).

    On a CPU build most are one missing optional package (multimodal models import ``torchvision``): the
    error is the host's, not the model's, and the same rows get a status of their own where it imports.
    """
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.status == NOT_LOADABLE:
            groups.setdefault(_import_error_of(r), []).append(r.architecture)
    return [{"import error": k, "architectures": len(v), "examples": ", ".join(v[:4]) + (" ..." if len(v) > 4 else "")}
            for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def write_registry_csv(rows: list[RegistryRow], path: str | Path) -> Path:
    """Every row (module, status, reason, class chain) as CSV, for the rows a page cannot show."""
    out = Path(path)
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["architecture", "kind", "module", "class_name", "status", "reason", "levels"])
        for r in rows:
            writer.writerow([r.architecture, r.kind, r.module, r.class_name, r.status, r.reason, r.levels])
    return out


# ---- the proof matrix (benchmarks/patch-matrix-<date>.json, made by benchmarks/tools/patch_matrix.py) ----------
# "patchable" above is read from the code; the matrix says which of those a real engine proved
# (eagle3lab patch --prove): the four columns of truth are native / proven / patchable but unproven / not patchable.
TRUTH = ("native", "proven", "patchable, unproven", "not patchable", NOT_LOADABLE)


def latest_proof_matrix(folder: str | Path) -> Path | None:
    """The newest ``patch-matrix-*.json`` in ``folder`` (by name: the date is in it), or None."""
    found = sorted(Path(folder).glob("patch-matrix-*.json"))
    return found[-1] if found else None


def read_proof_matrix(path: str | Path) -> dict[str, Any]:
    """The matrix file as written (``registry_vllm``, ``proving_vllm``, ``rows``: one per architecture)."""
    import json

    return json.loads(Path(path).read_text())


def truth_of(row: RegistryRow, proofs: dict[str, dict[str, Any]], matrix_vllm: str = "") -> tuple[str, str]:
    """(column, why) of one registry row given the matrix's rows by architecture: a patchable row is "proven"
    only when ``patch --prove`` passed for it; otherwise "patchable, unproven" with the proof's reason (or "not in
    the proof matrix"). A proof that failed keeps the row out of "proven" and says why."""
    if row.status != "patchable":
        return row.status, row.reason
    proof = proofs.get(row.architecture)
    if proof is None:
        made_on = f" (it lists vLLM {matrix_vllm}'s patchable rows as installed)" if matrix_vllm else ""
        return "patchable, unproven", f"not in the proof matrix{made_on}"
    if proof["status"] == "proven":
        return "proven", f"aux states within {proof['aux_max_rel_diff']:.1g} of transformers', greedy equal"
    return "patchable, unproven", f"{proof['status']}: {proof['reason']}"


def truth_counts(rows: list[RegistryRow], proofs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind, then "all": how many rows in each column of :data:`TRUTH`."""
    out = []
    for kind in (*sorted({r.kind for r in rows}), "all"):
        c = Counter(truth_of(r, proofs)[0] for r in rows if kind in ("all", r.kind))
        out.append({"kind": kind, **{col: c[col] for col in TRUTH}})
    return out


def unproven_rows(rows: list[RegistryRow], proofs: dict[str, dict[str, Any]],
                  matrix_vllm: str = "") -> list[dict[str, Any]]:
    """The rows called patchable that no engine has proven, each with why (the proof's own reason)."""
    return [{"architecture": r.architecture, "kind": r.kind, "why unproven": truth_of(r, proofs, matrix_vllm)[1]}
            for r in rows if truth_of(r, proofs)[0] == "patchable, unproven"]
