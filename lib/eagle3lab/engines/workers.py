"""What vLLM's workers run for us (through ``LLM.apply_model``): a report of the model they loaded, and the capture
of the aux hidden states each prefill returns.

These functions travel to the workers pickled by reference, so they live at module level in a module whose imports
are light (torch and :mod:`eagle3lab.vllm_compat`, which imports vLLM only when asked): every worker imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from eagle3lab.vllm_compat import supports_eagle3


@dataclass
class WorkerReport:
    """What one vLLM worker loaded: its top-level class, EAGLE-3 verdict and the inner forward it runs."""

    rank: int
    model_class: str
    supports_eagle3: bool
    inner_class: str | None
    inner_forward: str | None
    eagle3lab_forward: bool
    aux_layers: list[int] | None


def describe_loaded_model(model: Any) -> dict[str, Any]:
    """Run inside a vLLM worker (``LLM.apply_model``): a JSON-able :class:`WorkerReport` of ``model``."""
    lm = getattr(model, "language_model", None) or model  # Kimi-K2.5 wraps a DeepseekV3ForCausalLM
    inner = getattr(lm, "model", None)
    fwd = type(inner).forward if inner is not None else None
    aux = getattr(inner, "aux_hidden_state_layers", None)
    return {
        "rank": _rank(),
        "model_class": type(model).__name__,
        "supports_eagle3": bool(supports_eagle3(model)),
        "inner_class": type(inner).__name__ if inner is not None else None,
        "inner_forward": f"{fwd.__module__}.{fwd.__qualname__}" if fwd is not None else None,
        "eagle3lab_forward": bool(getattr(fwd, "__eagle3lab__", False)),
        "aux_layers": [int(x) for x in aux] if aux else None,
    }



# -- the aux-state capture of :class:`eagle3lab.engines.capture.EngineAuxSource`


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def install_aux_capture(model: Any) -> int:
    """Wrap ``model.forward`` so that every forward that returns aux states keeps them (on the CPU).

    Idempotent; returns 1 so that ``apply_model`` reports one answer per worker.
    """
    if "forward" in model.__dict__:  # already wrapped in this worker
        model._e3_captured = []  # noqa: SLF001
        return 1
    original = model.forward
    model._e3_captured = []  # noqa: SLF001

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        returned_aux = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (list, tuple)) and out[1]
        if returned_aux and _rank() == 0:
            model._e3_captured.append(torch.cat([a.detach() for a in out[1]], dim=-1).cpu())  # noqa: SLF001
        return out

    model.forward = forward
    return 1


def drain_aux_capture(model: Any) -> list[torch.Tensor]:
    """The states captured since the last drain ([tokens, n_aux * H] per forward; empty off rank 0)."""
    caps = list(getattr(model, "_e3_captured", []))
    model._e3_captured = []  # noqa: SLF001
    return caps


def remove_aux_capture(model: Any) -> int:
    """Back to the class's forward."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_e3_captured", None)
    return 1


