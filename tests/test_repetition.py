"""Repetition statistics: loops and distinct n-grams."""

from __future__ import annotations

import math

import pytest

from eagle3lab import repetition as R


def test_loops_are_found_with_their_period():
    seq = [9, 8] + [1, 2, 3] * 4 + [7, 6, 5, 4]
    assert (2, 14, 3) in R.loop_spans(seq)
    assert R.longest_loop(seq) == 12
    mask = R.loop_mask(seq)
    assert mask[2:14] == [True] * 12 and not any(mask[:2]) and not any(mask[14:])
    # A pattern seen only twice (one period of repeat) is not a loop; twice in a row of a long one is
    assert R.longest_loop([1, 2, 3, 4, 5, 6]) == 0
    assert R.longest_loop([5, 5, 5, 5]) == 0 and R.longest_loop([5] * 5) == 5  # min_run 4 for period 1
    assert R.longest_loop(list(range(10)) * 2) == 20  # period 10, repeated twice


def test_distinct_ngrams_and_summary():
    assert R.distinct_ngrams([[1, 2, 1, 2]], 2) == pytest.approx(2 / 3)
    assert math.isnan(R.distinct_ngrams([[1]], 2))
    st = R.repetition_stats([[1, 2, 3] * 5, list(range(10, 25))])
    assert st.sequences == 2 and st.tokens == 30 and st.distinct_tokens == 18
    assert st.loop_fraction == pytest.approx(15 / 30)
    assert st.longest_loop_max == 15 and st.longest_loop_median == 7.5
    # By hand: [1, 2, 3] * 5 has 12 4-grams of 3 kinds, range(10, 25) 12 of 12 kinds; pooled 15 of 24, and
    # the mean of the two sequences' own ratios (3/12 + 12/12) / 2. 2-grams: 3 + 14 kinds of 28.
    assert st.distinct_4gram == pytest.approx(15 / 24) and st.distinct_4gram_within == pytest.approx(0.625)
    assert st.distinct_2gram == pytest.approx(17 / 28)
    # Pooled and within differ when sequences repeat each other: two copies of 6 distinct tokens.
    twice = R.repetition_stats([list(range(6)), list(range(6))])
    assert twice.distinct_4gram == pytest.approx(3 / 6) and twice.distinct_4gram_within == pytest.approx(1.0)
    with pytest.raises(ValueError):
        R.repetition_stats([[]])


def test_rounds_split_by_loops():
    from eagle3lab.acceptance import SpecDecodeStats
    from eagle3lab.speculate import DecodeTrace, Round

    seq = [9, 8, 7] + [1, 2] * 6  # prompt of 3, then a loop of period 2
    tr = DecodeTrace(output=seq[3:], stats=SpecDecodeStats(),
                     rounds=[Round(1, [2, 1], 2, [2, 1, 2]), Round(4, [0, 0], 0, [1])])
    inside, outside = R.split_rounds_by_loops([seq, [5, 6, 7, 8]], [3, 2],
                                              [tr, DecodeTrace([7, 8], SpecDecodeStats(), [Round(1, [1, 1], 0, [8])])], 2)
    assert inside.num_drafts == 2 and inside.num_accepted_tokens == 2
    assert outside.num_drafts == 1 and outside.num_accepted_tokens == 0


def test_degeneracy_reasons_name_each_sign() -> None:
    from eagle3lab.repetition import degeneracy_reasons

    # the default run of 2026-11-29: the drafter (2.23) beats prompt lookup (1.95) but 54% of tokens are loops
    assert degeneracy_reasons(2.23, 1.95, 0.54) == [
        "a prompt-lookup drafter with no model reaches τ = 1.95 against the drafter's 2.23",
        "54% of the evaluated tokens lie inside loops",
    ]
    # copying explains less than half the gain and the text is mostly not loops: nothing to flag
    assert degeneracy_reasons(3.0, 1.9, 0.2) == []
    # loops alone are enough, and copying alone is enough
    assert len(degeneracy_reasons(3.0, 1.9, 0.5)) == 1
    assert len(degeneracy_reasons(3.0, 2.0, 0.1)) == 1
