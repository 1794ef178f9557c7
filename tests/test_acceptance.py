"""SpecDecodeStats arithmetic, vLLM metric snapshot conversion, figures."""

from __future__ import annotations

import math

import pytest

from eagle3lab.acceptance import (
    SpecDecodeStats,
    acceptance_length_figure,
    acceptance_table,
    layer_sweep_figure,
    per_position_figure,
    stats_from_vllm_metrics,
)


def test_record_and_derived_rates():
    s = SpecDecodeStats()
    for a in (3, 1, 0, 2):
        s.record_round(3, a)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 12, 6)
    assert s.accepted_per_pos == [3, 2, 1]
    assert s.accepted_hist == [1, 1, 1, 1]
    assert s.mean_acceptance_length == 1 + 6 / 4
    assert s.per_position_rate == [0.75, 0.5, 0.25]
    assert s.draft_acceptance_rate == 0.5
    # Mean acceptance length is 1 + the sum of per-position rates.
    assert math.isclose(s.mean_acceptance_length, 1 + sum(s.per_position_rate))
    with pytest.raises(ValueError):
        s.record_round(2, 3)


def test_add_sum_and_dict_round_trip():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record_round(2, 2)
    b.record_round(3, 1)
    c = a + b
    assert c.accepted_per_pos == [2, 1, 0] and c.num_draft_tokens == 5 and c.num_drafts == 2
    assert sum([a, b]) == c
    assert SpecDecodeStats.from_dict(c.to_dict()) == c
    empty = SpecDecodeStats()
    assert math.isnan(empty.mean_acceptance_length)


def test_from_vllm_metrics_snapshots():
    reader = pytest.importorskip("vllm.v1.metrics.reader")
    Counter, Vector, Gauge = reader.Counter, reader.Vector, reader.Gauge

    def snap(d, t, a, per_pos):
        return [
            Counter(name="vllm:spec_decode_num_drafts", labels={}, value=d),
            Counter(name="vllm:spec_decode_num_draft_tokens", labels={}, value=t),
            Counter(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=a),
            Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=per_pos),
            Gauge(name="vllm:num_requests_running", labels={}, value=1.0),
        ]

    before = snap(10, 30, 12, [7, 4, 1])
    after = snap(30, 90, 42, [22, 14, 6])
    s = stats_from_vllm_metrics(before, after)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (20, 60, 30)
    assert s.accepted_per_pos == [15, 10, 5]
    assert s.mean_acceptance_length == 2.5
    assert stats_from_vllm_metrics(None, after).num_drafts == 30
    with pytest.raises(ValueError, match="backwards"):
        stats_from_vllm_metrics(after, before)
    with pytest.raises(ValueError, match="no vllm:spec_decode"):
        stats_from_vllm_metrics(None, [Gauge(name="vllm:x", labels={}, value=0.0)])


def test_figures_and_table():
    s = SpecDecodeStats()
    for a in (3, 1, 2):
        s.record_round(3, a)
    rows = acceptance_table(s)
    assert [r["accepted"] for r in rows] == [3, 2, 1]
    assert math.isclose(rows[-1]["expected_length_up_to_here"], s.mean_acceptance_length)
    assert list(per_position_figure(s).data[0].y) == s.per_position_rate
    assert len(acceptance_length_figure(s).data[0].x) == 4
    no_hist = SpecDecodeStats(3, 9, 6, [3, 2, 1])
    assert list(acceptance_length_figure(no_hist).data[0].y)[-1] == pytest.approx(3.0)
    fig = layer_sweep_figure({"(2,3,5)": s, "(1,3,6)": no_hist})
    assert len(fig.data) == 2
    with pytest.raises(ValueError):
        layer_sweep_figure({})
