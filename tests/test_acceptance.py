"""SpecDecodeStats arithmetic, vLLM metric snapshot conversion, figures."""

from __future__ import annotations

import math

import pytest

from eagle3lab import acceptance as A
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


def test_conditional_and_cumulative_rates():
    s = SpecDecodeStats()
    for a in (3, 3, 1, 0):  # 4 rounds: position 1 reached 4x accepted 3x; position 2 reached 3x accepted 2x; ...
        s.record_round(3, a)
    assert s.per_position_rate == [0.75, 0.5, 0.5]
    assert s.conditional_rate == [0.75, 2 / 3, 1.0]  # cumulative falls, conditional rises
    never = SpecDecodeStats()
    never.record_round(2, 0)
    assert never.conditional_rate[0] == 0.0 and math.isnan(never.conditional_rate[1])


def _prompt(accepts, k=3):
    s = SpecDecodeStats()
    for a in accepts:
        s.record_round(k, a)
    return s


def test_prompt_intervals_pool_and_cover():
    per = [_prompt([3, 3, 2]), _prompt([0, 1, 0, 0]), _prompt([3, 2, 3])]
    iv = A.prompt_intervals(per, num_boot=500, seed=1)
    pooled = sum(per)
    assert iv.tau.value == pytest.approx(pooled.mean_acceptance_length)
    assert [c.value for c in iv.cumulative] == pytest.approx(pooled.per_position_rate)
    assert [c.value for c in iv.conditional] == pytest.approx(pooled.conditional_rate)
    assert iv.tau.lo <= iv.tau.value <= iv.tau.hi and iv.tau.lo < iv.tau.hi
    assert iv.per_prompt_tau == [p.mean_acceptance_length for p in per]
    # Identical prompts: the bootstrap has nothing to vary.
    same = A.prompt_intervals([_prompt([2, 1])] * 5, num_boot=200)
    assert same.tau.lo == same.tau.hi == same.tau.value
    assert A.prompt_intervals(per, num_boot=500, seed=1) == iv  # seeded
    with pytest.raises(ValueError, match="no prompt"):
        A.prompt_intervals([SpecDecodeStats()])
    rows = A.interval_table(iv)
    assert len(rows) == 3 and "[" in rows[0]["conditional (accepted at i / reached i)"]
    assert len(A.rates_figure(iv).data) == 2
    assert "cumulative rate goes from" in A.position_trend(iv)


def test_position_trend_follows_the_numbers():
    rising = A.prompt_intervals([_prompt([3, 3, 3, 0, 0, 0, 3, 3])] * 3, num_boot=100)
    # conditional 0.625 then 1.0, 1.0 with no spread: a real rise
    assert "rise" in A.position_trend(rising)
    falling = A.prompt_intervals([_prompt([1, 1, 1, 1, 2, 3])] * 3, num_boot=100)
    assert "fall with the position" in A.position_trend(falling)


def test_modelled_speedup():
    assert A.modelled_speedup(3.0, 3, 0.0) == 3.0
    assert A.modelled_speedup(3.0, 3, 0.1) == pytest.approx(3.0 / 1.3)
    with pytest.raises(ValueError):
        A.modelled_speedup(3.0, 0, 0.1)


def test_records_round_trip_and_token_view(tmp_path):
    from eagle3lab.speculate import DecodeTrace, Round

    st = _prompt([2, 0])
    tr = DecodeTrace(output=[5, 6, 7, 8, 9], stats=st,
                     rounds=[Round(1, [6, 7, 1], 2, [6, 7, 8]), Round(4, [4, 4, 4], 0, [9])])

    class Tok:
        def decode(self, ids):
            return "".join("<&>" if i == 9 else chr(97 + i) for i in ids)

    rec = A.make_record(tr, config="heldout/main/k3/T0", split="heldout", drafter="main", aux_layer_ids=[5, 1, 3],
                        k=3, temperature=0.0, prompt_index=4, prompt_ids=[1, 2], tokenizer=Tok())
    assert rec["aux_layer_ids"] == [1, 3, 5] and rec["source"] == "decoded"
    assert rec["output_pieces"] == ["f", "g", "h", "i", "<&>"]
    path = A.write_records(tmp_path / "a" / A.RECORDS, [rec])
    A.write_records(path, [rec], append=True)
    back = A.read_records(path)
    assert back == [rec, rec]
    assert A.stats_from_record(back[0]) == st
    html = A.token_view_html(back[0])
    assert "&lt;&amp;&gt;" in html and "<&>" not in html.split("</div>", 2)[-1]  # token text is escaped
    assert html.count("draft 1: accepted") == 1 and html.count("draft 2: accepted") == 1
    assert "draft 3: rejected" in html and "draft 1: rejected" in html and "<script" not in html


def test_records_for_labels_and_skips():
    from eagle3lab.speculate import DecodeTrace, Round

    tr = DecodeTrace(output=[5, 6], stats=_prompt([1], k=2), rounds=[Round(1, [6, 1], 1, [6])])
    recs = A.records_for([tr, tr, tr], [[1], [2], [3]], split="heldout", drafter="main", aux_layer_ids=[3, 1],
                         k=2, temperature=1.0, skip=[1])
    assert [r["prompt_index"] for r in recs] == [0, 2] and recs[1]["prompt_ids"] == [3]
    assert recs[0]["config"] == "heldout/main/k2/T1" and recs[0]["output_pieces"] == ["5", "6"]
    abl = A.records_for([tr], [[1]], split="heldout", drafter="[1, 3]", aux_layer_ids=[3, 1], k=2, temperature=0.0)
    assert abl[0]["config"] == "heldout/[1, 3]/k2/T0"


def test_engine_vs_reference_side_by_side_with_the_h200_figures():
    # counters of the H200 proof (benchmarks/gpu/20261129-h200/proofs): vLLM compiled vs the reference decoder
    vllm = A.SpecDecodeStats(num_drafts=820, num_draft_tokens=2460, num_accepted_tokens=1239,
                             accepted_per_pos=[548, 395, 296])
    ref = A.SpecDecodeStats(num_drafts=812, num_draft_tokens=2436, num_accepted_tokens=1247,
                            accepted_per_pos=[545, 403, 299])
    cmp = A.engine_vs_reference(vllm, ref)
    assert [r["position"] for r in cmp.rows] == [1, 2, 3, "τ"]
    assert cmp.rows[1]["gap"] == round(395 / 820 - 403 / 812, 4)
    assert cmp.max_gap == pytest.approx(abs(395 / 820 - 403 / 812)) and cmp.agree  # 0.015, as the proof says
    far = A.SpecDecodeStats(num_drafts=820, num_draft_tokens=2460, num_accepted_tokens=600,
                            accepted_per_pos=[400, 150, 50])
    assert not A.engine_vs_reference(far, ref).agree
    with pytest.raises(ValueError, match="no drafting rounds"):
        A.engine_vs_reference(A.SpecDecodeStats(), ref)


def test_implied_cost_ratio_inverts_the_modelled_speedup():
    from eagle3lab.acceptance import implied_cost_ratio, modelled_speedup

    c = implied_cost_ratio(2.5, 3, 400.0, 400.0 * modelled_speedup(2.5, 3, 0.2))
    assert c == pytest.approx(0.2)
    assert implied_cost_ratio(2.494, 3, 396.363, 334.703) == pytest.approx(0.651, abs=1e-3)  # 2026-12-03, H200
    with pytest.raises(ValueError):
        implied_cost_ratio(2.5, 0, 1.0, 1.0)
