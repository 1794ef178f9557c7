"""The aux hidden-state collection our DeepseekV2Model.forward uses, against a hand computation."""

from __future__ import annotations

import pytest
import torch

from eagle3lab.patch import run_layers_collecting_aux


class FakeLayer:
    """A decoder layer in vLLM's fused-residual style: returns (new hidden, new residual)."""

    def __init__(self, scale: float, shift: float) -> None:
        self.scale, self.shift = scale, shift

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Like vLLM: the layer first folds hidden into the residual stream (residual is None on layer 0).
        stream = hidden if residual is None else hidden + residual
        return stream * self.scale + self.shift, stream


def _call(layer: FakeLayer, h: torch.Tensor, r: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(h, r)


def _layers(n: int) -> list[FakeLayer]:
    return [FakeLayer(scale=0.5 + 0.25 * i, shift=float(i + 1)) for i in range(n)]


def _streams_by_hand(x: torch.Tensor, layers: list[FakeLayer]) -> list[torch.Tensor]:
    """stream[k] = hidden + residual at the input of layer k (k >= 1); stream[L] = final pre-norm state."""
    streams = [x]  # index 0 is only the embedding; vLLM has no residual there
    h, r = x, None
    for layer in layers:
        s = h if r is None else h + r
        if r is not None:
            streams.append(s)
        h, r = s * layer.scale + layer.shift, s
    streams.append(h + r)
    return streams


def test_collects_input_of_requested_layers_and_final_state() -> None:
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    layers = _layers(6)
    want = _streams_by_hand(x, layers)
    h, r, aux = run_layers_collecting_aux(layers, x, None, [2, 3, 6], call=_call)
    assert len(aux) == 3
    for got, k in zip(aux, [2, 3, 6], strict=True):
        torch.testing.assert_close(got, want[k])
    # Id 2 fully by hand: layer 0 passes x on as residual, so s1 = (0.5x + 1) + x = 1.5x + 1;
    # layer 1 gives 0.75*s1 + 2 with residual s1, so s2 = 1.75*s1 + 2 = 2.625x + 3.75.
    torch.testing.assert_close(aux[0], 2.625 * x + 3.75)
    # The final state equals what the loop hands to the norm.
    torch.testing.assert_close(aux[-1], h + r)


def test_ascending_order_whatever_the_request_order() -> None:
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layers = _layers(5)
    _, _, a = run_layers_collecting_aux(layers, x, None, (4, 1, 3), call=_call)
    _, _, b = run_layers_collecting_aux(layers, x, None, (1, 3, 4), call=_call)
    want = _streams_by_hand(x, layers)
    for got, exp, k in zip(a, b, (1, 3, 4), strict=True):
        torch.testing.assert_close(got, exp)
        torch.testing.assert_close(got, want[k])


def test_no_aux_requested_changes_nothing() -> None:
    x = torch.ones(3, 2)
    layers = _layers(3)
    h, r, aux = run_layers_collecting_aux(layers, x, None, (), call=_call)
    assert aux == []
    want = _streams_by_hand(x, layers)
    torch.testing.assert_close(h + r, want[-1])


def test_pipeline_slice_uses_global_ids_and_skips_final_when_asked() -> None:
    # A later pipeline rank runs layers 3..5 starting from the residual stream handed over.
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layers = _layers(6)
    want = _streams_by_hand(x, layers)
    h, r, _ = run_layers_collecting_aux(layers[:3], x, None, (), call=_call)
    _, _, aux = run_layers_collecting_aux(layers[3:], h, r, (2, 4, 6), call=_call, start_layer=3, collect_final=False)
    assert len(aux) == 1  # 2 belongs to the first rank; 6 (the final state) is left to the caller
    torch.testing.assert_close(aux[0], want[4])


def test_hooks_run_before_collection() -> None:
    x = torch.ones(2, 2)
    seen = []

    def prepare(layer, h, r):
        seen.append(layer)
        return h, r

    _, _, aux = run_layers_collecting_aux(
        _layers(3), x, None, (1, 2), call=_call, prepare=prepare, finish_aux=lambda s: s * 0
    )
    assert len(seen) == 3
    assert all(float(a.abs().sum()) == 0.0 for a in aux)


def test_id_zero_rejected_with_clear_error() -> None:
    with pytest.raises(ValueError, match="id 0"):
        run_layers_collecting_aux(_layers(3), torch.ones(1, 1), None, (0, 2), call=_call)
