"""Reference speculative decoding (greedy chain) over a transformers target, in plain PyTorch.

Each round: the drafter proposes k tokens from the target's aux states and its own hidden states, the
target scores the sequence plus all k drafts in one forward, the longest prefix equal to the target's
greedy choice is accepted, and the target's own next token (the correction, or a bonus after k accepted
drafts) is appended. The output therefore equals plain greedy decoding of the target whatever the
drafter proposes; only the number of target forwards changes.

For clarity the target and the drafter recompute the whole sequence every round (no KV cache): fine for
the short CPU sequences of the embedded profile. The verify forward also yields the aux states of every
accepted position, so the next round needs no extra target call.

The counters are vLLM's (see :mod:`eagle3lab.acceptance`). Every round counts k proposed drafts, also the
last one when its output is cut at ``max_new_tokens`` (vLLM counts what it verified, too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.drafter import Eagle3Drafter
from eagle3lab.hidden_states import target_forward_with_aux


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def greedy_generate(
    model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Plain greedy decoding by full recomputation (the reference the speculative decoder must equal)."""
    dev = _device(model)
    seq = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            logits = model(input_ids=torch.tensor([seq], device=dev), use_cache=False).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if eos_token_id is not None and tok == eos_token_id:
                break
    return out


def speculative_generate(
    model: nn.Module,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> tuple[list[int], SpecDecodeStats]:
    """Greedy chain speculative decoding; returns (new tokens, acceptance counters).

    Stops after exactly ``max_new_tokens`` new tokens (the last round is cut) or after emitting
    ``eos_token_id`` (included in the output, as greedy decoding does).
    """
    k = int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if not prompt_ids:
        raise ValueError("speculative_generate: empty prompt")
    stats = SpecDecodeStats(accepted_per_pos=[0] * k, accepted_hist=[0] * (k + 1))
    if max_new_tokens <= 0:
        return [], stats
    aux_ids = drafter.config.aux_layer_ids
    dev = _device(model)

    def forward(seq: list[int]):
        return target_forward_with_aux(model, torch.tensor([seq], device=dev), aux_ids)

    # Prefill: the target's first token, and aux states for every prompt position.
    seq = list(prompt_ids)
    tgt = forward(seq)
    out = [int(tgt.logits[0, -1].argmax())]
    seq.append(out[-1])
    aux = tgt.aux[0]  # [len(seq) - 1, width]: positions 0..len(seq)-2
    with torch.no_grad():
        while len(out) < max_new_tokens and not (eos_token_id is not None and out[-1] == eos_token_id):
            drafts = drafter.propose(torch.tensor(seq), aux, k)
            n0 = len(seq)
            tgt = forward(seq + drafts)
            # Target's greedy choice after seq + drafts[:i] sits at position n0 - 1 + i.
            choice = tgt.logits[0, n0 - 1 : n0 + k].argmax(-1).tolist()
            a = 0
            while a < k and drafts[a] == choice[a]:
                a += 1
            stats.record_round(k, a)
            new = drafts[:a] + [choice[a]]
            for tok in new:
                out.append(tok)
                seq.append(tok)
                if len(out) >= max_new_tokens or (eos_token_id is not None and tok == eos_token_id):
                    break
            # Positions up to len(seq) - 2 hold only accepted tokens, so their aux states are exact.
            aux = tgt.aux[0, : len(seq) - 1]
    return out, stats
