"""The aux-layer-id rules (eagle3lab.aux_layers): defaults, problems with codes, the SGLang convention."""

from __future__ import annotations

import pytest

from eagle3lab.aux_layers import (
    AuxLayerError,
    aux_id_problems,
    check_aux_layer_ids,
    default_aux_layer_ids,
    sglang_default_ids,
    sglang_to_vllm,
    vllm_to_sglang,
)


def test_defaults_are_vllms_rule():
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2.5
    assert default_aux_layer_ids(6) == [2, 3, 3]  # collapses: small targets need explicit ids


@pytest.mark.parametrize(
    ("ids", "num_layers", "codes"),
    [
        ([1, 3, 6], 6, []),
        ([2, 3, 3], 6, ["AUX_DUPLICATE"]),
        ([0, 3, 5], 6, ["AUX_ZERO"]),
        ([-1, 2], None, ["AUX_ZERO"]),
        ([2, 3, 7], 6, ["AUX_RANGE"]),
        ([2, 3, 7], None, []),  # unknown layer count: the range cannot be checked
        ([5, 2, 3], 6, ["AUX_ORDER"]),
        ([], 6, ["AUX_EMPTY"]),
        ([0, 0, 9], 6, ["AUX_DUPLICATE", "AUX_ZERO", "AUX_RANGE"]),  # every problem, not the first
    ],
)
def test_problems_have_codes(ids, num_layers, codes):
    assert [p.code for p in aux_id_problems(ids, num_layers)] == codes


def test_check_sorts_and_raises_with_every_error():
    assert check_aux_layer_ids([58, 2, 30], 61) == [2, 30, 58]  # order is only a warning
    with pytest.raises(AuxLayerError) as e:
        check_aux_layer_ids([0, 0, 9], 6)
    assert [p.code for p in e.value.problems] == ["AUX_DUPLICATE", "AUX_ZERO", "AUX_RANGE"]
    assert isinstance(e.value, ValueError) and "id 0" in str(e.value) and "out of range" in str(e.value)


def test_sglang_convention_is_one_layer_earlier():
    # SpecForge's DeepSeek-V3 config says [1, 29, 57]: vLLM's (2, 30, 58).
    assert sglang_default_ids(61) == [1, 29, 57]
    assert sglang_to_vllm([1, 29, 57]) == default_aux_layer_ids(61)
    assert vllm_to_sglang(sglang_to_vllm([4, 8])) == [4, 8]
