"""The cost model (eagle3lab.cost_model, 05's measured section): the arithmetic of step, round, c, τ/c and speedup
from hand-made timings and counters (every expected figure worked out by hand here, not with the module's own
helpers), the >10% explanation trigger, the split of a round, the forward timer's summary, the drafter timing, the
section on an engine that does not time, and the profile's refusal of bad batch sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from eagle3lab import acceptance_report as AR
from eagle3lab import cost_model as CM
from eagle3lab import params as P
from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.engines.base import Batch1Timing, DecodeTiming

ROOT = Path(__file__).resolve().parents[1]


def plain(batch: int, new_tokens: int, seconds: float, forward: float | None = None) -> DecodeTiming:
    return DecodeTiming(batch=batch, new_tokens=new_tokens, seconds=seconds, output_tokens=batch * new_tokens,
                        forward_seconds=forward)


def eagle3(batch: int, new_tokens: int, seconds: float, drafts: int, accepted: int, k: int = 3,
           forward: float | None = None) -> DecodeTiming:
    stats = SpecDecodeStats(num_drafts=drafts, num_draft_tokens=k * drafts, num_accepted_tokens=accepted)
    return DecodeTiming(batch=batch, new_tokens=new_tokens, seconds=seconds, output_tokens=batch * new_tokens,
                        num_speculative_tokens=k, stats=stats, forward_seconds=forward)


# --------------------------------------------------------------------------------------------- the arithmetic


def test_step_round_c_ceiling_and_speedup_by_hand():
    # Batch 8, 64 tokens each: plain 0.64 s -> step 10 ms. EAGLE-3: 160 drafts (20 rounds per request), 320
    # accepted -> tau 3; 0.40 s -> round 20 ms; c = 2; ceiling 1.5; speedup 0.64 / 0.40 = 1.6 (same 512 tokens).
    row = CM.CostRow(plain(8, 64, 0.64), eagle3(8, 64, 0.40, drafts=160, accepted=320))
    assert row.step_s == pytest.approx(0.010)
    assert row.round_s == pytest.approx(0.020)
    assert row.c == pytest.approx(2.0)
    assert row.tau == pytest.approx(3.0)
    assert row.ceiling == pytest.approx(1.5)
    assert row.speedup == pytest.approx(1.6)
    assert row.gap == pytest.approx(1.6 / 1.5 - 1)
    assert row.tokens_per_round == pytest.approx(512 / 160)
    assert not row.explain  # 6.7% apart
    m = row.metrics()
    assert m["plain_step_ms"] == pytest.approx(10.0) and m["eagle3_round_ms"] == pytest.approx(20.0)
    assert m["plain_tokens_per_s"] == pytest.approx(800.0) and m["eagle3_tokens_per_s"] == pytest.approx(1280.0)
    assert m["measured_speedup"] == pytest.approx(1.6) and m["ceiling"] == pytest.approx(1.5)
    assert m["num_drafts"] == 160 and m["num_accepted_tokens"] == 320 and m["explained"] is False
    json.dumps(m)  # what metrics.json stores


def test_measured_over_ceiling_is_output_tokens_over_the_rounds_tokens():
    # Whatever the wall times, the two runs' speedup over τ/c is T_eagle3 / (drafts + accepted) when both runs make
    # the same tokens: the gap is in tokens, not time.
    for seconds in ((0.9, 0.3), (0.2, 0.7), (1.0, 1.0)):
        row = CM.CostRow(plain(4, 32, seconds[0]), eagle3(4, 32, seconds[1], drafts=50, accepted=90))
        assert row.speedup / row.ceiling == pytest.approx(128 / (50 + 90))


@pytest.mark.parametrize(("measured", "ceiling", "explain"), [
    (1.09, 1.0, False), (1.11, 1.0, True), (0.91, 1.0, False), (0.89, 1.0, True), (2.0, 2.1, False), (2.0, 2.3, True),
])
def test_explanation_trigger_at_ten_percent(measured, ceiling, explain):
    assert CM.needs_explanation(measured, ceiling) is explain


def test_a_gap_beyond_ten_percent_is_explained_from_the_counters():
    # Batch 1, 8 tokens: 3 rounds accepted all 3 drafts each (tau 4), 12 tokens made + 1 from the prefill = 13, the
    # output kept 8: 5 dropped. measured / ceiling = 8 / 12: 33% below.
    over = CM.CostRow(plain(1, 8, 0.08), eagle3(1, 8, 0.06, drafts=3, accepted=9))
    assert over.explain and over.gap == pytest.approx(8 / 12 - 1)
    # Batch 1, 8 tokens: 2 rounds made 7 tokens (tau 3.5), the prefill 1: nothing dropped, the prefill is the gap.
    prefill = CM.CostRow(plain(1, 8, 0.08), eagle3(1, 8, 0.05, drafts=2, accepted=5))
    assert prefill.explain and prefill.gap == pytest.approx(8 / 7 - 1)
    within = CM.CostRow(plain(8, 64, 0.64), eagle3(8, 64, 0.40, drafts=160, accepted=320))
    cost = CM.CostModel(3, [over, prefill, within])
    text = cost.note()
    assert "Batch 1: measured 1.33x and ceiling 2.00x differ by -33%" in text
    assert "The 3 rounds made 12 tokens" in text and "5 tokens made past 8 per request were dropped" in text
    assert "the prefill's tokens are the whole gap" in text
    assert "Batch 8: measured within 10% of the ceiling (+6.7%)" in text
    assert [r["measured / ceiling − 1"] for r in cost.table_rows()] == ["-33.3%", "+14.3%", "+6.7%"]
    assert cost.metrics()["acceptance.cost_model"]["1"]["explained"] is True


def test_round_split_with_and_without_the_verify_pass():
    # step 10 ms, round 20 ms; target forward 8 ms for one token per request, 11 ms for k + 1: verify extra 3 ms;
    # drafter 4 ms; remainder 20 - 10 - 3 - 4 = 3 ms.
    row = CM.CostRow(plain(8, 64, 0.64, forward=0.008), eagle3(8, 64, 0.40, 160, 320, forward=0.011),
                     drafter_seconds=0.004)
    assert row.verify_extra_s == pytest.approx(0.003) and row.remainder_s == pytest.approx(0.003)
    m = row.metrics()
    assert m["verify_extra_ms"] == pytest.approx(3.0) and m["remainder_ms"] == pytest.approx(3.0)
    assert m["drafter_ms"] == pytest.approx(4.0) and m["verify_forward_ms"] == pytest.approx(11.0)
    (b,) = CM.CostModel(3, [row]).breakdown_rows()
    assert b["verify extra: the difference"] == "3.00"
    assert b["remainder: vLLM's proposer, rejection sampling, scheduling"] == "3.00"
    # Verify not measured: the remainder holds it too (20 - 10 - 4 = 6 ms), and says so.
    row = CM.CostRow(plain(8, 64, 0.64), eagle3(8, 64, 0.40, 160, 320), drafter_seconds=0.004)
    assert row.verify_extra_s is None and row.remainder_s == pytest.approx(0.006)
    (b,) = CM.CostModel(3, [row]).breakdown_rows()
    assert b["verify extra: the difference"] == "not measured"
    assert b["remainder: vLLM's proposer, rejection sampling, scheduling (+ verify extra)"] == "6.00"
    assert "verify pass's extra" in CM.CostModel(3, [row]).note()
    # No drafter timing: no remainder either.
    assert CM.CostRow(plain(8, 64, 0.64), eagle3(8, 64, 0.40, 160, 320)).remainder_s is None
    # A drafter timed slower than the round's time beyond the step: the split is said to be unresolved.
    slow = CM.CostRow(plain(8, 64, 0.64), eagle3(8, 64, 0.40, 160, 320), drafter_seconds=0.015)
    assert slow.remainder_s == pytest.approx(-0.005)
    assert "remainder -5.00 ms" in CM.CostModel(3, [slow]).note() and "not resolved" in CM.CostModel(3, [slow]).note()
    assert "not resolved" not in CM.CostModel(3, [row]).note()


def test_rows_refuse_mismatched_runs_and_runs_without_counters():
    with pytest.raises(ValueError, match="differ in batch"):
        CM.CostRow(plain(8, 64, 0.6), eagle3(4, 64, 0.4, 80, 100))
    with pytest.raises(ValueError, match="no spec-decode counters"):
        CM.CostRow(plain(8, 64, 0.6), plain(8, 64, 0.4))
    with pytest.raises(ValueError, match="no drafts"):
        _ = CM.CostRow(plain(8, 64, 0.6), eagle3(8, 64, 0.4, 0, 0)).round_s


def test_batch_prompts_repeat_the_list():
    assert CM.batch_prompts([[1], [2, 3], [4]], 7) == [[1], [2, 3], [4], [1], [2, 3], [4], [1]]
    assert CM.batch_prompts([[1], [2, 3], [4]], 2) == [[1], [2, 3]]
    with pytest.raises(ValueError):
        CM.batch_prompts([[1]], 0)
    with pytest.raises(ValueError):
        CM.batch_prompts([], 1)


def test_forward_summary_takes_only_forwards_of_the_step_size():
    recs = [(40, 0.5), (8, 0.010), (8, 0.014), (8, 0.011), (5, 0.001)]  # a prefill, three steps, a shrunk batch
    assert CM.forward_summary(recs, 8) == (pytest.approx(0.011), "median of 3 forwards of 8 tokens")
    s, why = CM.forward_summary(recs, 32)
    assert s is None and why.startswith("not measured") and "5 forwards of 5, 8, 40 tokens" in why
    assert CM.forward_summary([], 8)[0] is None


def test_forward_timer_in_a_module_records_tokens_and_restores_forward():
    # What runs in vLLM's workers, on a stand-in module called as vLLM calls the model.
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, input_ids, positions, intermediate_tensors=None):
            return positions if input_ids is None else input_ids * 2

    m = Model()
    info = CM.install_forward_timer(m)
    assert info == {"rank": 0, "device": "cpu", "dtype": "float32"}
    assert m(torch.arange(5), torch.arange(5)).tolist() == [0, 2, 4, 6, 8]
    m(input_ids=torch.arange(3), positions=torch.arange(3))
    m(input_ids=None, positions=torch.zeros(3, 7))  # M-RoPE positions: [3, tokens]
    recs = CM.drain_forward_timer(m)
    assert [n for n, _ in recs] == [5, 3, 7] and all(s >= 0 for _, s in recs)
    assert CM.drain_forward_timer(m) == []
    CM.remove_forward_timer(m)
    assert "forward" not in m.__dict__ and m(torch.arange(2), torch.arange(2)).tolist() == [0, 2]


# --------------------------------------------------------------------------------------------- the drafter


def tiny_drafter():
    from eagle3lab.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(vocab_size=64, draft_vocab_size=32, hidden_size=16, target_hidden_size=16,
                        aux_layer_ids=[1, 2, 3], intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    return Eagle3Drafter(cfg).eval()


@pytest.mark.parametrize("k", [1, 3])
def test_drafter_chain_is_timed_at_the_batch(k):
    d = CM.drafter_for_timing(tiny_drafter(), "cpu", "bfloat16")
    assert d.fc.weight.dtype == torch.bfloat16 and d.d2t.dtype == torch.long
    s = CM.drafter_chain_seconds(d, batch=4, k=k, context_len=12, repeats=3, warmup=1)
    assert 0 < s < 5
    with pytest.raises(ValueError):
        CM.drafter_chain_seconds(d, batch=0, k=k, context_len=12)


def test_drafter_round_on_a_cpu_takes_the_faster_thread_count_and_restores_it():
    d = CM.drafter_for_timing(tiny_drafter(), "cpu", "float32")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        s, used = CM.drafter_round_seconds(d, 2, 3, 8, repeats=2)
        assert s > 0 and used in (1, 2) and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert CM.drafter_round_seconds(d, 2, 3, 8, repeats=2)[1] == 1
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------- in 05


class TimingEngine:
    """generate / time_batch1 / speculative_generate / time_decode with fixed answers; records the calls."""

    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, max_new_tokens):
        self.calls.append(("generate", len(prompts)))
        return [[7] * max_new_tokens for _ in prompts]

    def time_batch1(self, prompts, max_new_tokens):
        self.calls.append(("batch1", len(prompts)))
        return Batch1Timing([0.1] * len(prompts), [max_new_tokens] * len(prompts))

    def speculative_generate(self, prompts, drafter_path, k, max_new_tokens):
        self.calls.append(("spec", len(prompts)))
        st = SpecDecodeStats(num_drafts=len(prompts), num_draft_tokens=k * len(prompts),
                             num_accepted_tokens=len(prompts), accepted_per_pos=[len(prompts)] + [0] * (k - 1))
        return type("R", (), {"outputs": [[7] * max_new_tokens for _ in prompts], "stats": st, "per_prompt": None,
                              "traces": None, "batch1": None, "baseline_seconds": None, "decode_seconds": None})()

    def time_decode(self, prompts, new_tokens, drafter_path=None, num_speculative_tokens=0):
        b = len(prompts)
        self.calls.append(("cost", "eagle3" if drafter_path else "plain", b, [p[0] for p in prompts]))
        if drafter_path is None:
            return plain(b, new_tokens, 0.01 * new_tokens, forward=0.008)
        rounds = math.ceil((new_tokens - 1) / 2)
        return eagle3(b, new_tokens, 0.015 * rounds, drafts=b * rounds, accepted=b * rounds,
                      k=num_speculative_tokens, forward=0.009)


def test_05_times_each_batch_in_the_engine_that_is_up_then_builds_the_section():
    eng = TimingEngine()
    prompts = [[1, 2], [3, 4, 5], [6]]
    dec = AR.decode_with_engine(eng, prompts, Path("d"), 3, 9, decode_prompts=2, batch1_prompts=1,
                                cost_batches=[1, 4])
    # plain batches while the plain engine is up, EAGLE-3 ones after the speculative run; the prompts repeat
    assert eng.calls == [("generate", 2), ("batch1", 1), ("cost", "plain", 1, [1]), ("cost", "plain", 4, [1, 3, 6, 1]),
                         ("spec", 2), ("cost", "eagle3", 1, [1]), ("cost", "eagle3", 4, [1, 3, 6, 1])]
    assert set(dec.seconds) == {"decode T=0", "cost model: timed batches"}
    cost = AR.cost_model(dec, 3, Path("unused"), prompts, engine_kind="vllm", drafter=tiny_drafter(), device="cpu",
                         dtype="float32", repeats=2)
    assert cost.measured and [r.batch for r in cost.rows] == [1, 4]
    got = cost.metrics()["acceptance.cost_model"]
    assert set(got) == {"1", "4"}
    for b, m in got.items():
        # 9 tokens: step 10 ms; 4 rounds per request at 15 ms each; c 1.5; tau 2; ceiling 4/3; speedup 0.09 / 0.06
        assert m["batch"] == int(b) and m["plain_step_ms"] == pytest.approx(10.0)
        assert m["eagle3_round_ms"] == pytest.approx(15.0) and m["c"] == pytest.approx(1.5)
        assert m["tau"] == pytest.approx(2.0) and m["ceiling"] == pytest.approx(4 / 3)
        assert m["measured_speedup"] == pytest.approx(1.5) and m["verify_extra_ms"] == pytest.approx(1.0)
        assert m["drafter_ms"] > 0 and m["remainder_ms"] == pytest.approx(15 - 10 - 1 - m["drafter_ms"])
    assert cost.metrics()["acceptance.cost_model_status"] == "measured"
    assert "profile (the engine reports none)" in cost.drafter_note and "timed inside the engine" in cost.verify_note
    assert cost.figure().data  # plotly builds it
    assert "cost model: drafter timing" in cost.seconds
    json.dumps(cost.metrics())


def test_05_on_the_reference_engine_says_not_measured():
    class Reference(TimingEngine):
        time_decode = None  # the reference engine has no such method: decode_with_engine must not call it

    eng = Reference()
    dec = AR.decode_with_engine(eng, [[1]], Path("d"), 3, 4, None, 1, cost_batches=[1, 8])
    assert dec.cost_plain is None and all(c[0] != "cost" for c in eng.calls)
    cost = AR.cost_model(dec, 3, Path("d"), [[1]], engine_kind="reference")
    assert not cost.measured and cost.note().startswith("**Not measured on the reference engine")
    assert cost.metrics() == {"acceptance.cost_model": {},
                              "acceptance.cost_model_status": cost.status}
    assert cost.status.startswith("not measured on the reference engine")


# --------------------------------------------------------------------------------------------- the profile


@pytest.mark.parametrize(("value", "why"), [
    ("[]", "at least one batch size"), ("[0]", "must be >= 1, got [0]"), ("[1, 8, -2]", "got [-2]"),
    ("[1, 8, 1]", "listed twice"),
])
def test_profile_refuses_bad_cost_batches(value, why):
    with pytest.raises(P.ParamsError) as e:
        P.load(ROOT / "tests" / "smoke.yaml", [f"acceptance.cost_batches={value}"])
    assert e.value.field == "acceptance.cost_batches" and why in e.value.reason


def test_profile_default_cost_batches():
    assert P.load(ROOT / "params" / "embedded.yaml").acceptance.cost_batches == [1, 8, 32]
    assert P.load(ROOT / "tests" / "smoke-glm4-moe.yaml").acceptance.cost_batches == [1, 2]


# --------------------------------------------------------------------------------------------- the served engine


def test_served_engine_times_batches_against_the_standin(tmp_path):
    # The stand-in (tests/standin_server.py) continues every prompt for max_tokens and counts ceil((n - 1) / 2)
    # rounds per request: the batch's counters and tokens come back, the forward is "not measured".
    from eagle3lab.engines.vllm_served import VllmServedEngine
    from test_serve import STANDIN, _Tok

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    with VllmServedEngine(target, log_dir=tmp_path / "logs", command=STANDIN, tokenizer=_Tok(), startup_timeout_s=30,
                          shutdown_grace_s=5) as eng:
        prompts = CM.batch_prompts([[1, 2], [5]], 3)
        p = eng.time_decode(prompts, 9)
        e = eng.time_decode(prompts, 9, drafter, 3)
    assert (p.batch, p.output_tokens, p.stats, p.num_speculative_tokens) == (3, 27, None, 0)
    assert (e.batch, e.output_tokens, e.num_speculative_tokens) == (3, 27, 3)
    assert e.stats.num_drafts == 3 * 4 and e.stats.num_accepted_tokens == 3 * 4  # the warm-up run is not counted
    assert p.seconds > 0 and e.seconds > 0
    assert p.forward_seconds is None and e.forward_note.startswith("not measured")
    row = CM.CostRow(p, e)
    assert row.tau == pytest.approx(2.0) and row.round_s == pytest.approx(e.seconds / 4)
