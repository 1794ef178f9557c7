"""01's four columns of truth: a row is "proven" only by a passing ``patch --prove`` in the proof matrix."""

from __future__ import annotations

import json

from eagle3lab.diagnose.registry import (
    NOT_LOADABLE,
    RegistryRow,
    latest_proof_matrix,
    truth_counts,
    truth_of,
    unproven_rows,
)


def _row(arch: str, status: str, kind: str = "text") -> RegistryRow:
    return RegistryRow(arch, kind, "m", arch, status, f"why {arch}")


ROWS = [_row("A", "native"), _row("B", "patchable"), _row("C", "patchable"), _row("D", "patchable"),
        _row("E", "not patchable"), _row("F", NOT_LOADABLE), _row("G", "patchable", "multimodal")]
PROOFS = {
    "B": {"status": "proven", "reason": "ok", "aux_max_rel_diff": 2e-6},
    "C": {"status": "failed", "reason": "failed: aux states equal transformers'", "aux_max_rel_diff": 0.8},
    "G": {"status": "unproven", "reason": "a multimodal wrapper", "aux_max_rel_diff": None},
}


def test_only_a_passing_proof_makes_a_row_proven():
    cols = {r.architecture: truth_of(r, PROOFS, "0.26.0")[0] for r in ROWS}
    assert cols == {"A": "native", "B": "proven", "C": "patchable, unproven", "D": "patchable, unproven",
                    "E": "not patchable", "F": NOT_LOADABLE, "G": "patchable, unproven"}
    why = {u["architecture"]: u["why unproven"] for u in unproven_rows(ROWS, PROOFS, "0.26.0")}
    assert why["C"].startswith("failed: ") and why["G"] == "unproven: a multimodal wrapper"
    assert why["D"] == "not in the proof matrix (it lists vLLM 0.26.0's patchable rows as installed)"


def test_counts_partition_the_rows():
    counts = {c["kind"]: c for c in truth_counts(ROWS, PROOFS)}
    total = counts["all"]
    assert sum(v for k, v in total.items() if k != "kind") == len(ROWS)
    assert total["proven"] == 1 and total["patchable, unproven"] == 3 and counts["multimodal"]["patchable, unproven"] == 1


def test_the_newest_matrix_is_read(tmp_path):
    assert latest_proof_matrix(tmp_path) is None
    for date in ("20261201", "20261207"):
        (tmp_path / f"patch-matrix-{date}.json").write_text(json.dumps({"rows": []}))
    assert latest_proof_matrix(tmp_path).name == "patch-matrix-20261207.json"
