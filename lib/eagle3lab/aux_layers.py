"""The rules for EAGLE-3 aux hidden-state layer ids, in one place (standard library only).

vLLM's convention: id ``k`` is the residual stream at the INPUT of decoder layer ``k`` (``hidden_states +
residual``, the stream after layer ``k-1``); id ``L`` (the number of layers) is the final state before the
last norm; id 0 does not exist (there is no residual before the first layer: vLLM 0.26 crashes on it).
States come back in ascending id order whatever order the ids are given in.

SGLang (and the drafters SpecForge and TorchSpec train) capture the OUTPUT of layer ``i``, which is
vLLM's id ``i + 1``. vLLM reads an SGLang id literally, one layer early, and nothing fails: acceptance
is just lower.

Every caller (params validation, hidden-state capture, the patched model's setter, diagnosis, lint)
asks :func:`aux_id_problems` and wraps the problems in its own wording; none re-states the rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Problem codes, most severe first. AUX_ORDER is only a warning: vLLM sorts, but a config that lists ids
# out of order suggests its author expected them in that order.
AUX_EMPTY = "AUX_EMPTY"
AUX_DUPLICATE = "AUX_DUPLICATE"
AUX_ZERO = "AUX_ZERO"
AUX_RANGE = "AUX_RANGE"
AUX_ORDER = "AUX_ORDER"
ERROR_CODES = frozenset({AUX_EMPTY, AUX_DUPLICATE, AUX_ZERO, AUX_RANGE})


@dataclass(frozen=True)
class AuxProblem:
    """One thing wrong with a list of aux ids: a stable ``code`` and a sentence that explains it."""

    code: str
    message: str

    @property
    def is_error(self) -> bool:
        """True unless the problem is only the order of the ids."""
        return self.code in ERROR_CODES


class AuxLayerError(ValueError):
    """Aux ids that vLLM cannot use; ``problems`` lists every reason, ``str()`` joins them."""

    def __init__(self, ids: list[int], problems: list[AuxProblem]) -> None:
        self.ids, self.problems = ids, problems
        super().__init__(f"aux layer ids {ids}: " + "; ".join(p.message for p in problems))


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default aux ids when the drafter config gives none: (2, L//2, L-3).

    For Kimi-K2.5 (61 layers) that is [2, 30, 58]. For 6 layers it is [2, 3, 3]: two distinct layers, and
    the drafter's fc fails with a shape error (seen on a GPU), so small targets must set ids explicitly.
    """
    return [2, num_layers // 2, num_layers - 3]


def aux_id_problems(ids: Iterable[int], num_layers: int | None = None) -> list[AuxProblem]:
    """Every problem with ``ids`` (vLLM convention) for a target of ``num_layers`` layers (None: unknown)."""
    ids = [int(i) for i in ids]
    if not ids:
        return [AuxProblem(AUX_EMPTY, "no ids: the drafter needs at least one target layer")]
    problems = []
    if len(set(ids)) < len(ids):
        problems.append(AuxProblem(
            AUX_DUPLICATE,
            f"duplicates: {len(ids)} ids name {len(set(ids))} distinct layers; the drafter's fc expects "
            f"{len(ids)} states and fails with a shape error",
        ))
    low = [i for i in ids if i <= 0]
    if low:
        problems.append(AuxProblem(
            AUX_ZERO,
            f"id {low[0]}: vLLM has no residual stream before layer 1 (id 0 crashes it); id k is the input of "
            "layer k, so ids start at 1",
        ))
    if num_layers is not None:
        high = [i for i in ids if i > num_layers]
        if high:
            problems.append(AuxProblem(
                AUX_RANGE,
                f"id {high[0]} is out of range for a target with {num_layers} layers (max id {num_layers}, the "
                "final pre-norm state)",
            ))
    if ids != sorted(ids):
        problems.append(AuxProblem(
            AUX_ORDER, "not ascending: vLLM returns the states in layer order, not in the order given"
        ))
    return problems


def check_aux_layer_ids(ids: Iterable[int], num_layers: int | None = None) -> list[int]:
    """The ids sorted ascending; :class:`AuxLayerError` listing every error when vLLM cannot use them."""
    ids = [int(i) for i in ids]
    errors = [p for p in aux_id_problems(ids, num_layers) if p.is_error]
    if errors:
        raise AuxLayerError(ids, errors)
    return sorted(ids)


def sglang_to_vllm(ids: Iterable[int]) -> list[int]:
    """SGLang ids (output of layer i) in vLLM's convention (input of layer i+1)."""
    return [int(i) + 1 for i in ids]


def vllm_to_sglang(ids: Iterable[int]) -> list[int]:
    """vLLM ids (input of layer k) in SGLang's convention (output of layer k-1)."""
    return [int(i) - 1 for i in ids]


def sglang_default_ids(num_layers: int) -> list[int]:
    """SGLang's default capture ids (1, L//2-1, L-4): vLLM's default rule, one layer earlier."""
    return vllm_to_sglang(default_aux_layer_ids(num_layers))
