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
