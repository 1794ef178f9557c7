"""Aux hidden states of a transformers target, in vLLM's convention: captured by hooks, computed by hand, and the
agreement of the two.

vLLM (0.26, ``DeepseekV2Model.forward``) captures for each requested id ``k`` the residual stream at the
INPUT of decoder layer ``k`` (``hidden_states + residual``, i.e. the stream after layer ``k-1``); id
``num_layers`` is the final state before the last norm, and id 0 does not exist (vLLM crashes on it). A
transformers decoder layer returns the full residual stream, so the input of layer ``k`` is exactly what
vLLM sums. We capture it with forward pre-hooks on the layers (and on the final norm for ``num_layers``)
instead of ``output_hidden_states``, whose last entry is post-norm in some models and versions.
The id rules are :mod:`eagle3lab.aux_layers`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3lab import aux_layers

# Agreement of the hook capture with the hand computation (verify_aux_mapping), relative to the states'
# scale: max|hooks - hand| / max|hand|. Both paths run the same float32 layers on the same inputs and
# differ only in how the causal mask reaches attention, so they agree to rounding: 0.0 measured on the
# test targets (CPU), and float32 rounding through a few layers stays below 1e-6. A wrong mapping is of
# order 1 (one layer off: 0.25 on the tiny target). 1e-4 is far from both. In bfloat16 rounding alone
# reaches ~1e-2, so the check is meant for float32 models.
AUX_AGREEMENT_TOL = 1e-4


@dataclass
class TargetOutput:
    """One target forward: logits and the concatenated aux states."""

    logits: torch.Tensor | None  # [B, T, V] float32; None when the forward stopped at the last aux layer
    aux: torch.Tensor  # [B, T, n_aux * H], aux states concatenated in ascending id order
    aux_layer_ids: list[int]  # sorted


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """Return (inner model, decoder layers, final norm) of a causal LM such as DeepseekV3ForCausalLM."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        get_decoder = getattr(model, "get_decoder", None)
        inner = get_decoder() if callable(get_decoder) else model
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise ValueError(
            f"{type(model).__name__}: cannot find decoder layers and final norm (expected .model.layers and "
            ".model.norm, as in DeepseekV3ForCausalLM)"
        )
    return inner, layers, norm


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Validate aux ids against vLLM's rules (:mod:`eagle3lab.aux_layers`) and return them sorted ascending."""
    try:
        return aux_layers.check_aux_layer_ids(aux_layer_ids, num_layers)
    except aux_layers.AuxLayerError as exc:
        reasons = "; ".join(p.message for p in exc.problems)
        raise ValueError(f"aux_layer_ids {exc.ids} for a target with {num_layers} layers: {reasons}") from None


def _first_tensor_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    # Decoder layers get hidden_states positionally in some transformers versions and by keyword in others.
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hs = kwargs.get("hidden_states")
    if not isinstance(hs, torch.Tensor):
        raise RuntimeError("aux capture: the hooked module was called without a hidden_states tensor")
    return hs


class _AuxComplete(Exception):
    """Raised by the last aux hook when the caller needs no logits: the rest of the forward is skipped."""


def target_forward_with_aux(
    model: nn.Module,
    input_ids: torch.Tensor,
    aux_layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
    logits: bool = True,
) -> TargetOutput:
    """Run the target once (no grad) and return logits plus aux states in vLLM's id convention.

    ``aux[..., j*H:(j+1)*H]`` is the state for the j-th smallest id. With ``logits=False`` the forward stops
    once the highest aux id is captured: extraction skips the layers above it and the LM head (whose
    [B, T, vocab] output is the largest tensor of a prefill), and ``logits`` is None. Raises ValueError for id 0,
    ids above ``num_layers``, duplicates or an empty list.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    _, layers, norm = decoder_parts(model)
    num_layers = len(layers)
    ids = check_aux_layer_ids(aux_layer_ids, num_layers)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(k: int):
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured[k] = _first_tensor_arg(args, kwargs).detach()
            if not logits and k == ids[-1]:
                raise _AuxComplete

        return hook

    handles = [
        (norm if k == num_layers else layers[k]).register_forward_pre_hook(make_hook(k), with_kwargs=True)
        for k in ids
    ]
    out = None
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _AuxComplete:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = [k for k in ids if k not in captured]
    if missing:
        raise RuntimeError(f"aux capture: layers {missing} were not reached during the forward")
    aux = torch.cat([captured[k] for k in ids], dim=-1)
    return TargetOutput(logits=out.logits.float() if out is not None else None, aux=aux, aux_layer_ids=ids)


def _causal_additive_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    # An additive float mask works for both eager and SDPA attention, unlike a boolean one.
    neg = torch.finfo(dtype).min
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    allowed = allowed[None, None].expand(batch, 1, length, length)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        # Rows of padding positions would be all-masked (NaN in softmax); let them see themselves.
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None, None]
    mask = torch.zeros(batch, 1, length, length, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, neg)


def hand_aux_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    aux_layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aux states computed by running the embedding and each decoder layer by hand (for verification)."""
    inner, layers, norm = decoder_parts(model)
    ids = check_aux_layer_ids(aux_layer_ids, len(layers))
    batch, length = input_ids.shape
    with torch.no_grad():
        h = inner.embed_tokens(input_ids)
        # Positions 0..T-1 as the model's own forward uses when none are given (we pad on the right).
        position_ids = torch.arange(length, device=input_ids.device)[None].expand(batch, length)
        position_embeddings = inner.rotary_emb(h, position_ids)
        mask = _causal_additive_mask(attention_mask, batch, length, h.dtype, h.device)
        states = {}
        for k, layer in enumerate(layers):
            if k in ids:
                states[k] = h
            out = layer(
                h,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                use_cache=False,
            )
            h = out[0] if isinstance(out, tuple) else out
        states[len(layers)] = h
        del norm  # the final norm is not part of any aux state
    return torch.cat([states[k] for k in ids], dim=-1)


def verify_aux_mapping(
    model: nn.Module,
    input_ids: torch.Tensor,
    aux_layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
    relative: bool = False,
) -> float:
    """Max abs difference between :func:`target_forward_with_aux` and :func:`hand_aux_states`.

    With ``relative`` it is divided by the largest magnitude of the hand-computed states: the quantity
    :data:`AUX_AGREEMENT_TOL` bounds.
    """
    got = target_forward_with_aux(model, input_ids, aux_layer_ids, attention_mask).aux.float()
    ref = hand_aux_states(model, input_ids, aux_layer_ids, attention_mask).float()
    if attention_mask is not None:
        keep = attention_mask.bool()[..., None]
        got, ref = got * keep, ref * keep
    diff = float((got - ref).abs().max())
    if relative:
        scale = float(ref.abs().max())
        return diff / scale if scale > 0 else diff
    return diff


# ---- an engine's aux states against transformers' (prove, 03's in-engine route) -------------------------------


class NonFiniteStates(ValueError):
    """A side of the comparison holds NaN or inf: there is nothing to compare (NaN compares false both ways)."""


_FINAL_NORMS = ("norm", "final_layernorm", "final_norm", "ln_f", "norm_f")


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    base = getattr(model, "model", None) or getattr(model, model.base_model_prefix, None) or model
    base = getattr(base, "language_model", base)  # multimodal wrappers keep the text model there
    for name in _FINAL_NORMS:
        mod = getattr(base, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


def aux_against_transformers(model: torch.nn.Module, aux: torch.Tensor, seqs: list[list[int]], ids: list[int],
                             hidden: int) -> tuple[float, dict[int, float], float]:
    """(largest relative difference, per id, smallest relative distance to a shifted id) between the engine's aux
    states ``aux`` (sequences x positions x ids*hidden) and ``model``'s residual stream at the same ids: vLLM's id
    k is transformers' ``hidden_states[k]`` for k < L, and the final norm's input for k = L (transformers'
    ``hidden_states[L]`` is taken after that norm). Differences are max |a - b| over the reference's max |b|.
    ValueError when the padding rows past a sequence are not empty (another sequence's states leaked in);
    NonFiniteStates (a ValueError) when either side holds NaN or inf values."""
    device = next(model.parameters()).device
    worst, nearest_wrong = 0.0, float("inf")
    per_id: dict[int, float] = {}
    seen: list[torch.Tensor] = []  # the final norm's input, per forward
    norm = _final_norm(model)
    handle = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].float().cpu().clone())) \
        if norm is not None else None
    try:
        for r, seq in enumerate(seqs):
            seen.clear()
            with torch.no_grad():
                hs = model(input_ids=torch.tensor([seq], device=device), output_hidden_states=True,
                           use_cache=False).hidden_states
            layers = [h[0].float().cpu() for h in hs[:-1]]
            if seen:
                layers.append(seen[-1])  # hs[L]: the pre-norm state, vLLM's id L
            got = aux[r, : len(seq)].view(len(seq), len(ids), hidden)
            # NaN compares false both ways: max() and min() would skip it and report a perfect match
            for name, t in (("the engine's aux states", got), ("transformers' hidden states", torch.stack(layers))):
                if not torch.isfinite(t).all():
                    raise NonFiniteStates(f"sequence {r}: {name} hold NaN or inf values, nothing to compare")
            for j, k in enumerate(ids):
                if k >= len(layers):
                    raise ValueError(f"id {k}: transformers gave {len(layers)} states and no final norm was found")
                ref = layers[k]
                scale = float(ref.abs().max())
                diff = float((got[:, j] - ref).abs().max()) / scale
                per_id[k] = max(per_id.get(k, 0.0), diff)
                worst = max(worst, diff)
                for other in (k - 1, k + 1):  # a shifted id: what a wrong mapping would capture
                    if 0 <= other < len(layers):
                        nearest_wrong = min(nearest_wrong, float((got[:, j] - layers[other]).abs().max()) / scale)
            if aux[r, len(seq):].any():
                raise ValueError(f"sequence {r}: the rows past its {len(seq)} tokens are not empty")
    finally:
        if handle is not None:
            handle.remove()
    return worst, per_id, nearest_wrong
