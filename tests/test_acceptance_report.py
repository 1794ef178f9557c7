"""05's sections (eagle3lab.acceptance_report) on small hand-made inputs: values worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3lab import acceptance as A
from eagle3lab import acceptance_report as AR
from eagle3lab import overview
from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.engines.base import Batch1Timing


def stats(k: int, accepted: list[int]) -> SpecDecodeStats:
    """Counters of rounds that each proposed k drafts and accepted the given numbers."""
    st = SpecDecodeStats(accepted_per_pos=[0] * k, accepted_hist=[0] * (k + 1))
    for a in accepted:
        st.record_round(k, a)
    return st


def trace(k: int, accepted: list[int], output: list[int] | None = None, complete: bool = False) -> object:
    from eagle3lab.speculate import DecodeTrace, Round

    rounds, start = [], 1
    for a in accepted:
        rounds.append(Round(start=start, drafted=[7] * min(a + 1, k), accepted=a, emitted=[7] * (a + 1)))
        start += a + 1
    return DecodeTrace(output=output or [7] * start, stats=stats(k, accepted), rounds=rounds, complete_drafts=complete)


class FakeEngine:
    """generate / speculative_generate with fixed answers; records the calls."""

    def __init__(self, greedy, spec_outputs, per_prompt, traces=None, seconds=(None, None)):
        self.greedy, self.spec_outputs, self.per_prompt, self.traces = greedy, spec_outputs, per_prompt, traces
        self.seconds = seconds
        self.calls = []

    def generate(self, prompts, max_new_tokens):
        self.calls.append(("generate", len(prompts), max_new_tokens))
        return self.greedy[: len(prompts)]

    def speculative_generate(self, prompts, drafter_path, k, max_new_tokens, temperature=0.0, seed=None):
        self.calls.append(("spec", len(prompts), k, temperature, seed))
        n = len(prompts)
        return SimpleNamespace(outputs=self.spec_outputs[:n], stats=sum(self.per_prompt[:n]),
                               per_prompt=self.per_prompt[:n], traces=self.traces,
                               baseline_seconds=self.seconds[0], decode_seconds=self.seconds[1])


# --------------------------------------------------------------------------------------------- inputs, records


def test_heldout_prompts_cut_and_missing(tmp_path):
    f = tmp_path / "heldout_prompts.jsonl"
    with pytest.raises(FileNotFoundError, match="run 03_engine first"):
        AR.heldout_prompts(f, 2)
    f.write_text("".join(json.dumps({"prompt_ids": [i, i + 1]}) + "\n" for i in range(5)))
    assert AR.heldout_prompts(f, 2) == [[0, 1], [1, 2]]
    assert AR.setup_rows(2, 3, 16, "reference", Path("/d")) == {
        "held-out prompts": 2, "k (num_speculative_tokens)": 3, "max_new_tokens": 16, "engine": "reference",
        "drafter": "/d"}


def test_records_fresh_add_skip_and_empty(tmp_path):
    path = tmp_path / "acceptance" / AR.RECORDS
    path.parent.mkdir()
    path.write_text("stale\n")
    rec = AR.Records.fresh(path, [[1, 2], [3, 4, 5]], [4, 1, 2])
    assert not path.exists()  # written afresh
    rec.add(None, k=2, temperature=0.0)
    rec.add([], k=2, temperature=0.0)
    assert not path.exists()  # an engine without traces writes nothing
    rec.add([trace(2, [2, 0]), trace(2, [1])], k=2, temperature=0.0)
    rec.add([trace(2, [1]), trace(2, [0])], k=2, temperature=1.0, skip=[0])
    rec.add([trace(3, [3])], k=3, temperature=0.0, drafter="[1, 2]", aux_layer_ids=[2, 1], split="humaneval",
            prompts=[[9]])
    got = A.read_records(path)
    assert [(r["config"], r["prompt_index"]) for r in got] == [
        ("heldout/main/k2/T0", 0), ("heldout/main/k2/T0", 1), ("heldout/main/k2/T1", 1), ("humaneval/[1, 2]/k3/T0", 0)]
    assert got[0]["aux_layer_ids"] == [1, 2, 4] and got[0]["prompt_ids"] == [1, 2]
    assert got[3]["prompt_ids"] == [9] and got[3]["drafter"] == "[1, 2]"
    assert [r["accepted"] for r in got[0]["rounds"]] == [2, 0]


# --------------------------------------------------------------------------------------------- engine decoding


def test_decode_with_engine_counts_mismatches_and_records():
    per = [stats(2, [2, 1]), stats(2, [0]), stats(2, [2])]
    eng = FakeEngine(greedy=[[1], [2], [3]], spec_outputs=[[1], [9], [3]], per_prompt=per, seconds=(3.0, 1.5))
    dec = AR.decode_with_engine(eng, [[0]] * 5, Path("d"), 2, 8, decode_prompts=3, batch1_prompts=16)
    assert eng.calls == [("generate", 3, 8), ("spec", 3, 2, 0.0, None)]
    assert dec.decoded == 3 and dec.mismatch == [1]
    assert list(dec.seconds) == ["decode T=0"]
    rows = dec.rows()
    assert rows["outputs equal greedy decoding"] is False
    assert rows["mismatching prompts"] == "1 of 3 (indices [1])"
    # 4 rounds, 5 accepted drafts: τ = 1 + 5/4.
    assert rows["drafts (rounds)"] == 4 and rows["accepted tokens"] == 5 and rows["τ"] == 2.25
    m = dec.metrics()
    assert list(m) == ["acceptance.outputs_match_greedy", "acceptance.decoded_prompts", "acceptance.decoded_stats",
                       "acceptance.mismatching_prompts", "acceptance.first_divergence", "acceptance.measured_speedup"]
    assert m["acceptance.outputs_match_greedy"] is False and m["acceptance.measured_speedup"] == 2.0
    assert m["acceptance.mismatching_prompts"] == 1 and m["acceptance.first_divergence"] == {"1": 0}
    assert m["acceptance.decoded_stats"]["num_accepted_tokens"] == 5


class TimingEngine(FakeEngine):
    """A FakeEngine that also times prompts one at a time, as the vLLM engines do."""

    def time_batch1(self, prompts, max_new_tokens):
        self.calls.append(("batch1", len(prompts), max_new_tokens))
        # 10 tokens per prompt in 0.1 s each: 100 tok/s without speculation
        return Batch1Timing([0.1] * len(prompts), [10] * len(prompts))

    def speculative_generate(self, prompts, *a, **kw):
        res = super().speculative_generate(prompts, *a, **kw)
        # the EAGLE-3 engine's per-prompt runs: the first two at 250 tok/s, the third slower
        res.batch1 = Batch1Timing([0.04, 0.04, 1.0][: len(prompts)], [10] * len(prompts))
        return res


def test_decode_measures_the_batch1_speedup_on_the_same_first_prompts():
    per = [stats(2, [2])] * 3
    eng = TimingEngine([[1]] * 3, [[1]] * 3, per, seconds=(1.0, 2.0))
    dec = AR.decode_with_engine(eng, [[0]] * 3, Path("d"), 2, 8, decode_prompts=3, batch1_prompts=2)
    # the baseline is timed while the plain engine is up, before the EAGLE-3 engine starts
    assert eng.calls == [("generate", 3, 8), ("batch1", 2, 8), ("spec", 3, 2, 0.0, None)]
    # only the first two of the EAGLE-3 per-prompt runs count: 20 tokens in 0.08 s against 20 in 0.2 s
    assert dec.batch1 == (pytest.approx(100.0), pytest.approx(250.0))
    assert dec.measured_speedup_batch1 == pytest.approx(2.5) and dec.measured_speedup == 0.5
    rows = dec.rows()
    assert rows["wall time without / with EAGLE-3, 3 prompts at once"] == "1.00 s / 2.00 s (0.50x)"
    assert rows["tokens/s without / with EAGLE-3, one prompt at a time (2 prompts)"] == "100 / 250 (2.50x)"
    m = dec.metrics()
    assert m["acceptance.measured_speedup_batch1"] == pytest.approx(2.5) and m["acceptance.batch1_prompts"] == 2
    assert m["acceptance.batch1_tokens_per_s"] == {"baseline": pytest.approx(100.0), "eagle3": pytest.approx(250.0)}
    # more batch-1 prompts asked for than decoded: the decoded ones
    eng = TimingEngine([[1]] * 3, [[1]] * 3, per)
    AR.decode_with_engine(eng, [[0]] * 5, Path("d"), 2, 8, decode_prompts=3, batch1_prompts=16)
    assert eng.calls[1] == ("batch1", 3, 8)


def test_decode_all_prompts_when_unset_and_no_speedup_without_wall_times():
    per = [stats(1, [1])] * 2
    dec = AR.decode_with_engine(FakeEngine([[1], [2]], [[1], [2]], per), [[0], [0]], Path("d"), 1, 4, None, 16)
    assert dec.decoded == 2 and dec.mismatch == []
    assert dec.measured_speedup is None and "acceptance.measured_speedup" not in dec.metrics()
    assert dec.measured_speedup_batch1 is None and "acceptance.measured_speedup_batch1" not in dec.metrics()
    assert dec.rows()["mismatching prompts"] == "0 of 2"
    assert "first differing token (min / median / max)" not in dec.rows()
    assert dec.metrics()["acceptance.first_divergence"] == {}


def test_first_divergence_is_the_first_differing_token():
    """Where a speculative output parts from the greedy one: a late near-tie and a bug look different here."""
    greedy = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2]]
    spec = [[5, 6, 9, 9], [5, 6, 7, 8], [4, 6, 7, 8], [1, 2, 3]]  # differs at 2, equal, at 0, longer (at 2)
    per = [stats(1, [1])] * 4
    dec = AR.decode_with_engine(FakeEngine(greedy, spec, per), [[0]] * 4, Path("d"), 1, 4, None, 16)
    assert dec.mismatch == [0, 2, 3]
    assert dec.first_divergence == {0: 2, 2: 0, 3: 2}
    assert dec.rows()["first differing token (min / median / max)"] == "0 / 2 / 2"


def test_sample_with_engine_seeds_each_temperature_and_refuses_zero():
    eng = FakeEngine([], [[1]] * 3, [stats(1, [1])] * 3)
    out = AR.sample_with_engine(eng, [[0]] * 10, Path("d"), 1, 4, [0.5, 1.0], sampled_prompts=3, seed=7)
    assert out.prompts == 3 and list(out.by_temperature) == [0.5, 1.0]
    assert eng.calls == [("spec", 3, 1, 0.5, 7), ("spec", 3, 1, 1.0, 7)]
    assert list(out.seconds) == ["decode T=0.5", "decode T=1"]
    with pytest.raises(ValueError, match="0 is not above 0"):
        AR.sample_with_engine(eng, [[0]], Path("d"), 1, 4, [0.0], 1, 0)


# --------------------------------------------------------------------------------------------- replay


def test_reference_engine_choices():
    inproc = SimpleNamespace(model=object())
    assert AR.reference_engine(inproc, target_source="checkpoint", target_path=Path("t"), device="cpu",
                               dtype="float32") is inproc
    closed = []
    served = SimpleNamespace(close=lambda: closed.append(1))
    assert AR.reference_engine(served, target_source="checkpoint", target_path=Path("t"), device="cpu",
                               dtype="float32") is None
    assert closed == []  # a checkpoint profile keeps its engine
    assert AR.num_target_layers(None) is None
    assert AR.num_target_layers(SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=6)))) == 6
    assert AR.k_values(3, 7) == [1, 2, 3, 4, 5, 6, 7] and AR.k_values(4, 2) == [1, 2, 3, 4]


def test_check_replay_same_decoder_compares_counters():
    per = [stats(2, [2, 1]), stats(2, [0])]
    dec = AR.EngineDecode(2, [[1], [2]], SimpleNamespace(per_prompt=per, stats=sum(per), traces=None, outputs=[[1], [2]]))
    traces = [SimpleNamespace(stats=stats(2, [2, 1])), SimpleNamespace(stats=stats(2, [1])),
              SimpleNamespace(stats=stats(2, [2]))]
    chk = AR.check_replay(traces, dec, same_engine=True, engine_kind="reference")
    assert chk.metrics == {"acceptance.replay_matches_decoded": False}
    assert chk.note == "The exact replay equals the decoder's counters on 1 of 2 prompts." and chk.rows is None
    traces[1] = SimpleNamespace(stats=stats(2, [0]))
    assert AR.check_replay(traces, dec, True, "reference").metrics["acceptance.replay_matches_decoded"] is True


def test_check_replay_other_engine_within_tolerance():
    engine_stats = stats(2, [2, 1, 0, 2])  # per position 3/4, 2/4
    dec = AR.EngineDecode(2, [], SimpleNamespace(per_prompt=None, stats=engine_stats, traces=None, outputs=[]))
    traces = [SimpleNamespace(stats=stats(2, [2, 1])), SimpleNamespace(stats=stats(2, [1, 2])),
              SimpleNamespace(stats=stats(2, [0]))]  # the first two prompts: per position 4/4, 2/4
    chk = AR.check_replay(traces, dec, same_engine=False, engine_kind="vllm")
    m = chk.metrics
    assert m["acceptance.engine_per_position"] == [0.75, 0.5]
    assert m["acceptance.reference_per_position"] == [1.0, 0.5]
    assert m["acceptance.engine_reference_max_gap"] == 0.25 and m["acceptance.engine_reference_agree"] is False
    assert chk.note.startswith("vllm and the reference decoder DISAGREE: the largest gap between their "
                               "per-position rates is 0.250 (tolerance 0.05)")
    assert chk.rows[-1]["position"] == "τ" and chk.caption.startswith("acceptance per draft position on the same 2")


def test_replay_skip_only_at_the_decoded_k_with_traces():
    with_traces = AR.EngineDecode(3, [], SimpleNamespace(traces=[1]))
    assert list(AR.replay_skip(2, 2, with_traces)) == [0, 1, 2]
    assert list(AR.replay_skip(3, 2, with_traces)) == []
    assert list(AR.replay_skip(2, 2, AR.EngineDecode(3, [], SimpleNamespace(traces=None)))) == []


# --------------------------------------------------------------------------------------------- summaries


def test_per_position_metrics_note_and_conclusion():
    per = [stats(2, [2, 2]), stats(2, [1, 0])]  # 4 rounds: position 1 accepted 3 times, position 2 twice
    pos = AR.per_position(per, 2, seed=0)
    m = pos.metrics()
    assert list(m)[:2] == ["acceptance.k", "acceptance.mean_acceptance_length"]
    assert m["acceptance.k"] == 2 and m["acceptance.mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert m["acceptance.cumulative_rate"] == pytest.approx([0.75, 0.5])
    assert m["acceptance.per_position_rate"] == m["acceptance.cumulative_rate"]
    assert m["acceptance.conditional_rate"] == pytest.approx([0.75, 2 / 3])
    assert m["acceptance.draft_acceptance_rate"] == pytest.approx(5 / 8) and m["acceptance.num_drafts"] == 4
    lo, hi = m["acceptance.tau_ci95"]
    assert lo <= 2.25 <= hi
    assert pos.caption() == "2 held-out prompts, k = 2, temperature 0; [95% interval]"
    assert pos.note().startswith(f"τ = **2.25** [{lo:.2f}, {hi:.2f}] of a possible 3. The cumulative rate goes from 0.75")
    assert pos.conclusion(None, False) == (f"τ = 2.25 [{lo:.2f}, {hi:.2f}] of a possible 3 at k = 2 on 2 held-out "
                                           "prompts; conditional acceptance 0.75, 0.67")
    assert pos.conclusion(1.5, True).endswith("; HumanEval τ = 1.50; inflated by repetition")
    assert len(pos.figures()) == 3


def test_tau_by_k_rows_metrics_and_note():
    traces = {1: [SimpleNamespace(stats=stats(1, [1, 0]))], 2: [SimpleNamespace(stats=stats(2, [2, 1]))]}
    # τ(k=1) = 1.5, τ(k=2) = 2.5; c = 0.25: speedups 1.5/1.25 = 1.2 and 2.5/1.5 = 1.67.
    res = AR.tau_by_k(traces, 2, 2.5, (0.001, 0.004, 0.25), None, seed=0)
    assert [r["k"] for r in res.rows()] == [1, 2]
    assert [r["modelled speedup"] for r in res.rows()] == [1.2, 1.67]
    m = res.metrics()
    assert m["acceptance.tau_by_k"] == {"1": 1.5, "2": 2.5} and m["acceptance.cost_ratio"] == 0.25
    assert m["acceptance.modelled_speedup"] == pytest.approx(2.5 / 1.5)
    assert m["acceptance.modelled_speedup_by_k"] == {"1": 1.2, "2": 1.67}
    assert res.caption().startswith("drafter step 1.00 ms, target decode step 4.00 ms: c = 0.250")
    assert "Modelled speedup at k = 2: **1.67×**" in res.note() and "best k here is 2 (1.67×)" in res.note()
    assert "No measured speedup" in res.note()
    measured = AR.tau_by_k(traces, 2, 2.5, (0.001, 0.004, 0.25), 1.234, seed=0)
    assert "Measured by the engine, warm: **1.23×** with the prompts decoded at once." in measured.note()
    both = AR.tau_by_k(traces, 2, 2.5, (0.001, 0.004, 0.25), 0.5, seed=0, measured_speedup_batch1=1.5)
    assert "**0.50×** with the prompts decoded at once, **1.50×** one prompt at a time." in both.note()


def test_temperature_summary():
    sampled = AR.SampledDecode(2, {1.0: SimpleNamespace(per_prompt=[stats(2, [0]), stats(2, [1])], stats=None),
                                   0.5: SimpleNamespace(per_prompt=None, stats=stats(2, [2]))})
    t = AR.temperature_summary([stats(2, [2]), stats(2, [2, 0])], sampled, seed=0)
    rows = t.rows()
    assert [r["temperature"] for r in rows] == ["0 (greedy)", "1", "0.5"] and {r["prompts"] for r in rows} == {2}
    assert rows[0]["τ"].startswith("2.333 [") and rows[1]["conditional rates"] == "0.50, 0.00"
    assert t.metrics() == {"acceptance.tau_t1": 1.5, "acceptance.tau_by_temperature": {"0": pytest.approx(7 / 3),
                                                                                       "1": 1.5, "0.5": 3.0}}
    no_t1 = AR.temperature_summary([stats(2, [2])], AR.SampledDecode(1, {}), seed=0)
    assert no_t1.metrics() == {"acceptance.tau_by_temperature": {"0": 3.0}}


def test_token_view_records_pick_the_median_prompt_and_its_sampled_runs():
    def rec(i, accepted, T=0.0, source="decoded", k=2):
        return {"config": f"heldout/main/k{k}/T{T:g}", "source": source, "prompt_index": i, "k": k,
                "temperature": T, "rounds": [{"accepted": a} for a in accepted]}

    recs = [rec(0, [2, 2]), rec(1, [0, 0]), rec(2, [1, 1]), rec(3, [0], source="simulated"),
            rec(2, [0], T=1.0), rec(1, [0], T=1.0), rec(2, [0], T=1.0, k=3)]
    assert AR.token_view_records(recs, 2) == [recs[2], recs[4]]  # τ 3, 1, 2: median 2 is prompt 2
    # Without decoded records, simulated ones are used.
    sim = [rec(0, [2], source="simulated"), rec(1, [1], source="simulated"), rec(2, [0], source="simulated")]
    assert AR.token_view_records(sim, 2) == [sim[1]]


# --------------------------------------------------------------------------------------------- repetition


def _continuation(prompt, gen):
    import torch

    from eagle3lab.speculate import Continuation

    seq = list(prompt) + list(gen)
    return Continuation(prompt_len=len(prompt), sequence=seq, aux=torch.zeros(len(seq), 1), layer_ids=[1])


def test_repetition_without_replay_measures_the_training_text_only():
    pos = AR.per_position([stats(2, [1])], 2, seed=0)
    rep = AR.repetition([[1, 2, 3, 4, 5, 6], [1, 2, 1, 2, 1, 2, 1, 2]], pos, None, 2, 8, None, seed=0)
    m = rep.metrics()
    assert list(m) == ["acceptance.train_distinct_4gram", "acceptance.train_loop_fraction", "acceptance.degenerate",
                       "acceptance.degenerate_reason"]
    # 3 + 5 four-grams, distinct: 3 + 2; the second sequence is one loop (8 of 14 tokens).
    assert m["acceptance.train_distinct_4gram"] == pytest.approx(5 / 8)
    assert m["acceptance.train_loop_fraction"] == pytest.approx(8 / 14)
    assert m["acceptance.degenerate"] is False and m["acceptance.degenerate_reason"] == ""
    assert rep.baseline_rows() is None and rep.note() is None and rep.caveat() is None
    assert [(r["text"], r["tokens in loops"]) for r in rep.rows()] == [(AR.TRAIN_TEXT, round(8 / 14, 3))]


def test_repetition_with_a_looping_replay_is_degenerate():
    from eagle3lab.speculate import replay_drafter

    loop = [5, 6] * 8
    conts = [_continuation([1, 2, 5, 6], loop), _continuation([3, 4, 5, 6], loop)]
    ngram = replay_drafter(None, conts, [2], 8)[2]  # prompt lookup copies the loop: every draft accepted
    replay = AR.Replay(None, conts, {2: ngram})
    pos = AR.per_position([t.stats for t in ngram], 2, seed=0)
    rep = AR.repetition([[1, 2, 3, 4]], pos, replay, 2, 8, None, seed=0)
    m = rep.metrics()
    assert m["acceptance.eval_loop_fraction"] == 1.0 and m["acceptance.ngram_tau"] == pytest.approx(pos.tau)
    assert m["acceptance.tau_in_loops"] == pytest.approx(pos.tau) and m["acceptance.tau_outside_loops"] is None
    assert m["acceptance.degenerate"] is True
    assert m["acceptance.degenerate_reason"].endswith("100% of the evaluated tokens lie inside loops")
    assert rep.caveat().endswith("No round starts outside a loop, so this text cannot show what the drafter "
                                 "predicts beyond copying.")
    assert rep.note() == "**" + rep.caveat() + "**"
    rows = rep.baseline_rows()
    assert rows[1]["drafter"] == "prompt lookup (no model)" and rows[3]["τ"] == "nan (0 rounds)"
    assert AR.repetition_line(rep, None).startswith(f"**Repetition:** prompt lookup alone reaches τ = {pos.tau:.2f}")


def test_generated_cuts_the_prompt_and_the_tail():
    assert AR.generated([_continuation([1, 2], [3, 4, 5])], 2) == [[3, 4]]


# --------------------------------------------------------------------------------------------- HumanEval, layers


def test_humaneval_rows_and_metrics():
    from eagle3lab.repetition import repetition_stats

    iv = A.prompt_intervals([stats(1, [1, 0])], seed=0)
    he = AR.HumanEval(1, [[1], [2], [3]], [], iv, A.prompt_intervals([stats(1, [0, 0])], seed=0),
                      repetition_stats([[1, 2, 3]]))
    held = AR.Repetition(1, {AR.TRAIN_TEXT: repetition_stats([[1]]), AR.EVAL_TEXT: repetition_stats([[1, 1, 1, 1, 1]])},
                         AR.per_position([stats(1, [1])], 1, seed=0), ngram=iv)
    rows = he.rows(held, 4)
    assert rows[0] == {"prompts": "held-out split (4)", "τ at k=1": "2.00 [2.00, 2.00]", "prompt lookup τ": "1.50",
                       "tokens in loops": "100%"}
    assert rows[1]["prompts"] == "HumanEval (3)" and rows[1]["prompt lookup τ"] == "1.00"
    assert [r["τ at k=1"] for r in rows[2:]] == [v for _, v in AR.PUBLISHED_TAU]
    assert he.metrics() == {"acceptance.humaneval_tau": 1.5, "acceptance.humaneval_tau_ci95": [1.5, 1.5],
                            "acceptance.humaneval_prompts": 3, "acceptance.humaneval_ngram_tau": 1.0,
                            "acceptance.humaneval_loop_fraction": 0.0}


def test_probe_rows_metrics_and_line():
    res = SimpleNamespace(top_k=5, lens_top1=[0.1, 0.2, 0.9], tuned_top1=[0.3, 0.25, 0.95], tuned_topk=[0.5, 0.6, 0.99])
    ids = [1, 2, 3]
    assert AR.probe_rows(ids, res)[1] == {"aux id": 2, "logit lens top-1": 0.2, "tuned lens top-1": 0.25,
                                          "tuned lens top-5": 0.6}
    m = AR.probe_metrics(ids, res, num_layers=3)
    assert m["acceptance.probe_top1"] == {"1": 0.3, "2": 0.25, "3": 0.95}
    assert m["acceptance.probe_best_layer"] == 1  # the final state (id 3) is left out
    assert AR.probe_metrics([3], SimpleNamespace(tuned_top1=[0.9], tuned_topk=[1.0], lens_top1=[0.9]), 3)[
        "acceptance.probe_best_layer"] == 3
    line = AR.probe_line(ids, res, 3, [1, 3])
    assert "id 1: 30%, id 2: 25%, id 3: 95% (logit lens: 10%, 20%, 90%)" in line
    assert line.endswith("The best state before the final one is id 1 (30%); the drafter reads ids [1, 3].")


def test_ablation_from_results():
    sets = [SimpleNamespace(name="profile", ids=[1, 2], why=""), SimpleNamespace(name="late", ids=None, why="too few"),
            SimpleNamespace(name="early", ids=[1], why="")]
    good = [stats(1, [1, 1])] * 3
    bad = [stats(1, [0, 0])] * 3
    trained = [(SimpleNamespace(name="profile", ids=[1, 2], per_prompt=good, train_seconds=2.04,
                                train_accuracy=[0.51234]), ["t1"]),
               (SimpleNamespace(name="early", ids=[1], per_prompt=bad, train_seconds=1.0, train_accuracy=[0.1]), ["t2"])]
    abl = AR.ablation_from_results(trained, sets, seed=0)
    assert list(abl.seconds) == ["ablation [1, 2]", "ablation [1]"]
    assert abl.metrics() == {"acceptance.ablation": {"profile [1, 2]": 2.0, "early [1]": 1.0},
                             "acceptance.ablation_ci95": {"profile [1, 2]": [2.0, 2.0], "early [1]": [1.0, 1.0]},
                             "acceptance.ablation_best": "profile [1, 2]", "acceptance.ablation_resolved": True,
                             "acceptance.ablation_tied_with_best": []}
    rows = abl.rows()
    assert rows[0] == {"set": "profile", "aux ids": [1, 2], "τ": "2.000 [2.000, 2.000]", "train accuracy (pos 1)": 0.512,
                       "seconds": 2.0}
    assert rows[2] == {"set": "late", "aux ids": "–", "τ": "skipped: too few"}
    assert abl.traces == [([1, 2], ["t1"]), ([1], ["t2"])]
    line = abl.line(64, 300)
    assert line.startswith("**Ablation:** best set profile [1, 2] (τ = 2.00 [2.00, 2.00]), worst early [1] (τ = 1.00")
    assert ("; the intervals do not overlap. The best set's interval lies above every other set's. All were trained "
            "64 steps (04's drafter: 300)") in line


def test_ablation_names_no_winner_within_the_noise():
    """Three sets: the best and the middle one overlap (a tie), the worst lies below both."""
    sets = [SimpleNamespace(name=n, ids=[i], why="") for i, n in enumerate(("a", "b", "c"), 1)]
    a = [stats(1, [1, 1]), stats(1, [1, 0])] * 3  # per-prompt tau 2 and 1.5: around 1.75
    b = [stats(1, [1, 0]), stats(1, [1, 1]), stats(1, [1, 0])] * 2  # 1.5, 2, 1.5: around 1.67, overlapping a
    c = [stats(1, [0, 0])] * 6  # tau 1 exactly
    trained = [(SimpleNamespace(name=n, ids=[i], per_prompt=pp, train_seconds=1.0, train_accuracy=[0.5]), [])
               for (n, i, pp) in (("a", 1, a), ("b", 2, b), ("c", 3, c))]
    abl = AR.ablation_from_results(trained, sets, seed=0)
    lo_a, hi_b = abl.results["a"][1].tau.lo, abl.results["b"][1].tau.hi
    assert abl.results["a"][1].tau.value > abl.results["b"][1].tau.value and hi_b >= lo_a  # the premise
    m = abl.metrics()
    assert m["acceptance.ablation_best"] == "a [1]" and m["acceptance.ablation_resolved"] is False
    assert m["acceptance.ablation_tied_with_best"] == ["b [2]"]
    assert "overlaps 1 other set(s) (b [2]): no winner is named" in abl.line(64, 300)
    rows = {r.label: r for g in overview.headline({**m, "acceptance.k": 2}) for r in g.rows}
    assert rows["tau per aux-layer set"].context.startswith("best: none resolved (a [1] leads")


def test_closing_and_timings():
    assert AR.closing_note([None, None]) == "No per-layer views ran."
    assert AR.closing_note(["a", None, "b"]) == "a\n\nb"
    assert AR.timing_rows({"x": 1.26, "y": 0.04}) == {"x": 1.3, "y": 0.0}
    assert AR.interval_text(A.Interval(1.23456, 1.0, math.pi), 2) == "1.23 [1.00, 3.14]"


def test_record_writes_in_order():
    seen = []
    AR.record(SimpleNamespace(record=lambda k, v: seen.append((k, v))), {"b": 1, "a": 2})
    assert seen == [("b", 1), ("a", 2)]


def test_divergence_check_measures_the_parting_token_in_float32():
    import torch

    from eagle3lab import target as T
    from test_hidden_states import _Tok

    model = T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0).eval().to(torch.bfloat16)
    prompts = [[3, 7, 11], [9, 2, 4]]
    greedy = [[5, 6, 7], [8, 9, 10]]
    same = AR.EngineDecode(2, greedy, SimpleNamespace(outputs=[list(g) for g in greedy]))
    assert AR.divergence_check(model, prompts, same) is None  # nothing to explain
    dec = AR.EngineDecode(2, greedy, SimpleNamespace(outputs=[[5, 6, 7], [8, 3, 10]]))
    check = AR.divergence_check(model, prompts, dec)
    assert next(model.parameters()).dtype == torch.bfloat16  # the caller's model is left as it was
    (row,) = check.rows
    assert (row["prompt"], row["first differing token"], row["greedy's token"], row["speculative's token"]) == (1, 1, 9, 3)
    with torch.no_grad():
        logits = model.float()(input_ids=torch.tensor([[9, 2, 4, 8]])).logits[0, -1]
    summ = check.metrics["acceptance.divergence"]
    assert summ["differing_at_a_token"] == 1 and summ["first_positions"] == [1]
    assert summ["largest_margin"] == pytest.approx(float((logits[9] - logits[3]).abs()), abs=1e-4)
    assert "of 1 prompt part where" in check.note
    # a bf16 target also yields the measured yardstick, over the greedy continuations (2 prompts x 3 tokens)
    assert summ["precision_error"]["positions"] == 6 and summ["precision_error"]["dtype"] == "bfloat16"
    share = summ["divergences"][0]["share_moved_this_far"]
    assert row["bfloat16 moves a margin this far at"] == f"{share:.2%} of positions" and 0 <= share <= 1


def test_divergence_text_says_which_yardstick_and_which_run_left_float32():
    from eagle3lab import divergence as DV

    err = DV.PrecisionError("bfloat16", 100, 2, tuple(i / 100 for i in range(100)))
    both = [DV.Divergence(0, 3, 1, 2, 10.0, 9.7, argmax=1, top2_margin=0.3),
            DV.Divergence(1, 5, 1, 2, 10.0, 9.5, argmax=2, top2_margin=0.5)]
    text = AR.divergence_text(DV.summarise(both, compared=4, error=err))
    assert "another token than float32 at 2.00% of them" in text and "by 0.990 or more at 1.00% of them" in text
    assert "2 of 2 prompts part where the float32 margin is within that:" in text
    assert "both runs leave float32's choice" in text
    far = [DV.Divergence(0, 3, 1, 2, 10.0, 8.0, argmax=1, top2_margin=2.0)]
    text = AR.divergence_text(DV.summarise(far, compared=4, error=err))
    assert "0 of 1 prompt part" in text and "look at those prompts" in text and "only the speculative run" in text
    text = AR.divergence_text(DV.summarise(far, compared=4))  # no measured error: the bf16-steps rule
    assert "within 4 bf16 steps" in text and "look at those prompts" in text
    greedy_off = [DV.Divergence(0, 3, 1, 2, 10.0, 9.9, argmax=2, top2_margin=0.1)]
    assert "only the plain greedy run" in AR.divergence_text(DV.summarise(greedy_off, compared=1))
    # one prompt sided with greedy, one with neither token: both runs left float32 somewhere
    mixed = far + [DV.Divergence(1, 4, 1, 2, 10.0, 9.9, argmax=5, top2_margin=0.2)]
    text = AR.divergence_text(DV.summarise(mixed, compared=4))
    assert "neither at 1 prompt" in text and "both runs leave" in text and "only the" not in text
    # outputs that differ only in length leave no token to compare
    assert "only in length" in AR.divergence_text(DV.summarise([], compared=4, error=err))


# --------------------------------------------------------------------------------------------- HumanEval on vLLM


def test_humaneval_through_the_engine_reads_its_counters():
    """On vLLM the HumanEval prompts also go through the engine's speculative decoding; τ is its counters'.
    Rounds accepted 3, 1, 0 and 2 of k=3: τ = 1 + 6/4 = 2.5, positions 3/4, 2/4, 1/4."""
    per_prompt = [stats(3, [3, 1]), stats(3, [0, 2])]
    eng = FakeEngine(None, [[1], [2]], per_prompt)
    he = AR.humaneval_with_engine(eng, "vllm", [[5, 6], [7]], Path("/d"), 3, 24)
    assert eng.calls == [("spec", 2, 3, 0.0, None)]
    m = he.metrics()
    assert m["acceptance.humaneval_engine_tau"] == pytest.approx(2.5)
    assert m["acceptance.humaneval_engine_drafts"] == 4
    assert m["acceptance.humaneval_engine_per_position_rate"] == pytest.approx([0.75, 0.5, 0.25])
    row = he.row(2.4)
    assert row["τ at k=3, vLLM's counters"] == "2.500" and row["τ, exact replay"] == "2.400"
    assert row["HumanEval prompts"] == 2 and row["new tokens each"] == 24
    # the reference engine: its decoder is the replay itself, nothing more to run
    ref = FakeEngine(None, [], [])
    assert AR.humaneval_with_engine(ref, "reference", [[5]], Path("/d"), 3, 24) is None and ref.calls == []
    # counters that never moved are an error, not a tau of 1
    with pytest.raises(RuntimeError, match="did not move"):
        AR.humaneval_with_engine(FakeEngine(None, [[1]], [stats(3, [])]), "vllm", [[5]], Path("/d"), 3, 24)
