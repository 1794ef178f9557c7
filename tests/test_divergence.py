"""divergence: the first differing token of two outputs, and the float32 target's margin between the two
choices there (what tells a bf16 near-tie from a run that did not emit the target's argmax)."""

from __future__ import annotations

import pytest
import torch

from eagle3lab import divergence as D
from eagle3lab import target as T
from test_hidden_states import _Tok

PROMPTS = [[3, 7, 11, 5], [9, 2, 4], [6, 6, 1, 8, 2]]


@pytest.fixture(scope="module")
def model():
    return T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0).eval()


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def _runner_up(model, prefix: list[int]) -> tuple[int, float, float]:
    logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
    top = torch.topk(logits, 2)
    return int(top.indices[1]), float(top.values[0]), float(top.values[1])


def test_first_difference():
    assert D.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert D.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert D.first_difference([1, 2], [1, 2, 3]) == 2  # one run stopped earlier


def test_margins_of_a_flipped_token(model):
    greedy = [_greedy(model, p, 6) for p in PROMPTS]
    flipped = [list(g) for g in greedy]
    # prompt 1: the second token replaced by the target's runner-up there (what a near-tie flip looks like)
    second, best_logit, second_logit = _runner_up(model, PROMPTS[1] + greedy[1][:2])
    flipped[1] = greedy[1][:2] + [second, 0, 0, 0]
    flipped[2] = greedy[2][:4]  # prompt 2: shorter only, nothing to compare
    divs = D.divergence_margins(model, PROMPTS, greedy, flipped)
    assert [(d.prompt, d.position) for d in divs] == [(1, 2)]
    d = divs[0]
    assert (d.token_a, d.token_b, d.argmax) == (greedy[1][2], second, greedy[1][2])
    assert d.logit_a == pytest.approx(best_logit, abs=1e-5) and d.logit_b == pytest.approx(second_logit, abs=1e-5)
    assert d.margin == pytest.approx(d.top2_margin, abs=1e-5) and d.margin > 0
    s = D.summarise(divs, compared=len(PROMPTS))
    assert s["compared"] == 3 and s["differing_at_a_token"] == 1 and s["first_positions"] == [2]
    assert s["near_ties"] == int(d.margin <= 4 * d.bf16_resolution)
    assert s["divergences"][0]["margin"] == pytest.approx(d.margin)


def test_bf16_resolution_follows_the_logits_size():
    d = D.Divergence(0, 0, 1, 2, logit_a=10.0, logit_b=9.99, argmax=1, top2_margin=0.01)
    assert d.bf16_resolution == 2.0 ** -4  # 10 lies in [8, 16): bf16 steps of 8 / 128
    s = D.summarise([d], compared=1)
    assert s["near_ties"] == 1 and s["largest_margin"] == pytest.approx(0.01)
    far = D.Divergence(0, 0, 1, 2, logit_a=10.0, logit_b=7.0, argmax=1, top2_margin=3.0)
    assert D.summarise([far], compared=1)["near_ties"] == 0


def test_refuses_bf16_model_and_ragged_inputs(model):
    with pytest.raises(ValueError, match="counts must agree"):
        D.divergence_margins(model, PROMPTS, [[1]], [[1]])
    half = T.build_model(model.config, seed=0).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        D.divergence_margins(half, PROMPTS[:1], [[1]], [[2]])


def test_precision_error_is_nil_between_equal_precisions_and_measured_in_bf16(model):
    greedy = [_greedy(model, p, 6) for p in PROMPTS]
    seqs = [p + g for p, g in zip(PROMPTS, greedy, strict=True)]
    lens = [len(p) for p in PROMPTS]
    same = D.precision_error(model, T.build_model(model.config, seed=0).eval(), seqs, lens)
    assert same.positions == 18 and same.argmax_flips == 0 and same.largest == 0.0  # 3 prompts x 6 tokens
    half = T.build_model(model.config, seed=0).eval().to(torch.bfloat16)
    err = D.precision_error(model, half, seqs, lens)
    assert err.dtype == "bfloat16" and err.positions == 18 and err.largest > 0  # bf16 does round
    # every position by hand: position j of a sequence predicts token j + 1, from the prompt's last token on
    shifts, flips = [], 0
    with torch.no_grad():
        for seq, n in zip(seqs, lens, strict=True):
            for j in range(n - 1, len(seq) - 1):
                ids = torch.tensor([seq[:j + 1]])
                l32, low = model(input_ids=ids).logits[0, -1], half(input_ids=ids).logits[0, -1].float()
                top = torch.topk(l32, 2).indices
                shifts.append(float(((low[top[0]] - low[top[1]]) - (l32[top[0]] - l32[top[1]])).abs()))
                flips += int(low.argmax() != top[0])
    assert err.argmax_flips == flips
    assert err.margin_errors == pytest.approx(sorted(shifts), abs=1e-5)
    assert err.share_at_least(0.0) == 1.0 and err.share_at_least(err.largest + 1) == 0.0
    assert err.quantile(1.0) == err.largest and err.quantile(0.5) <= err.quantile(0.99) <= err.largest
    with pytest.raises(ValueError, match="float32"):
        D.precision_error(half, model, seqs, lens)
    with pytest.raises(ValueError, match="prompt lengths"):
        D.precision_error(model, half, seqs, lens[:1])


def test_summarise_reads_divergences_against_a_measured_error():
    err = D.PrecisionError("bfloat16", 4, 1, (0.01, 0.02, 0.1, 0.5))
    assert err.flip_rate == 0.25 and err.to_dict()["margin_error_max"] == 0.5
    near = D.Divergence(0, 3, 1, 2, logit_a=10.0, logit_b=9.7, argmax=2, top2_margin=0.3)  # 4.8 bf16 steps
    far = D.Divergence(1, 5, 1, 2, logit_a=10.0, logit_b=9.0, argmax=1, top2_margin=1.0)
    s = D.summarise([near, far], compared=8, error=err)
    assert s["near_ties"] == 0 and s["within_measured_error"] == 1  # the rule of thumb and the measure disagree
    assert (s["argmax_is_a"], s["argmax_is_b"]) == (1, 1)
    assert [r["share_moved_this_far"] for r in s["divergences"]] == [0.25, 0.0]
    assert s["yardstick"] == 0.5 and s["yardstick_share"] == 0.25  # the 99.9% quantile of 4 shifts is the largest
    median = D.summarise([near, far], compared=8, error=err, within_quantile=0.5)
    assert median["yardstick"] == 0.02 and median["within_measured_error"] == 0
    assert "precision_error" not in D.summarise([near], compared=1)
    neither = D.Divergence(2, 1, 1, 2, logit_a=5.0, logit_b=4.9, argmax=7, top2_margin=0.5)
    assert D.summarise([near, neither], compared=2)["argmax_is_neither"] == 1
