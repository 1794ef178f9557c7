"""vLLM's spec-decode metrics as a real engine reports them, read by our code.

The fixtures ``tests/fixtures/vllm_metrics_*.json`` are snapshots of ``LLM.get_metrics()`` before and after
a speculative-decoding workload on a GPU (``benchmarks/tools/gpu_engine_proofs.py`` writes them: ``before``/``after``
lists of {name, labels, value | values}, plus ``k`` and the ``stats`` that run computed). They are the
independent truth for the metric names and shapes :func:`eagle3lab.acceptance.stats_from_vllm_metrics`
assumes; nothing here builds a snapshot under the names the code expects.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3lab.acceptance import stats_from_vllm_metrics

FIXTURES = sorted((Path(__file__).resolve().parent / "fixtures").glob("vllm_metrics_*.json"))
if not FIXTURES:
    pytestmark = pytest.mark.skip(
        reason="no tests/fixtures/vllm_metrics_*.json yet: they come from a real engine on a GPU "
        "(benchmarks/tools/gpu_engine_proofs.py), none has been captured in this checkout"
    )


def _objects(snapshot: list[dict]) -> list[SimpleNamespace]:
    # get_metrics() returns objects with .name/.value(s); the fixture stores them as dicts.
    return [SimpleNamespace(**m) for m in snapshot]


def _counter(snapshot: list[dict], name: str) -> float:
    return sum(m.get("value", 0) for m in snapshot if m["name"] == name)


@pytest.mark.parametrize("path", FIXTURES or [None], ids=[p.stem for p in FIXTURES] or ["none"])
def test_real_snapshots_give_consistent_counters(path):
    fx = json.loads(path.read_text())
    names = {m["name"] for m in fx["after"]}
    for needed in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                   "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert needed in names, f"{path.name}: a real engine reported no {needed}"
    stats = stats_from_vllm_metrics(_objects(fx["before"]), _objects(fx["after"]))
    # Plain arithmetic over the raw snapshot, independent of the code under test.
    for field, name in (("num_drafts", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                        ("num_accepted_tokens", "num_accepted_tokens")):
        raw = _counter(fx["after"], f"vllm:spec_decode_{name}") - _counter(fx["before"], f"vllm:spec_decode_{name}")
        assert getattr(stats, field) == raw, field
    k = int(fx["k"])
    assert stats.num_drafts > 0
    assert stats.num_draft_tokens == k * stats.num_drafts  # chain drafting: k tokens per draft
    assert len(stats.accepted_per_pos) == k
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_per_pos, stats.accepted_per_pos[1:], strict=False))
    assert 1.0 <= stats.mean_acceptance_length <= k + 1
    recorded = fx.get("stats") or {}
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        if field in recorded:
            assert recorded[field] == getattr(stats, field), f"{field}: differs from what the GPU run computed"
