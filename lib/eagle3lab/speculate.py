"""Reference speculative decoding (chain drafting) over a transformers target, in plain PyTorch.

Each round: the drafter proposes k tokens from the target's aux states and its own hidden states, the
target scores the sequence plus all k drafts in one forward, and the drafts are verified:

- temperature 0: the longest prefix equal to the target's greedy choice is accepted, then the target's own
  next token (the correction, or a bonus after k accepted drafts) is appended. The output equals plain greedy
  decoding whatever the drafter proposes; only the number of target forwards changes.
- temperature T > 0: rejection sampling, the definition of EAGLE and vLLM: draft token x at position i is
  accepted with probability min(1, p_i(x) / q_i(x)) (p: the target's softmax at T, q: the distribution the
  draft was drawn from); at the first rejection a token is drawn from norm(max(0, p_i - q_i)) and the round
  ends; after k acceptances a bonus token is drawn from p_k. Every emitted token is then distributed as the
  target's own sampling (tested in tests/test_speculate.py). vLLM's EAGLE proposer drafts greedily (q is
  one-hot on the argmax, so acceptance is p_i(x)); ``draft_sampling="sample"`` draws drafts from the
  drafter's softmax at T instead.

For clarity the target and the drafter recompute the whole sequence every round (no KV cache): fine for
the short CPU sequences of the embedded profile, and the reason its wall time says nothing about speed.

:func:`replay_greedy` computes the same greedy rounds without running the decoder: at temperature 0 the
output is the target's greedy continuation, so one target forward over it gives every aux state, one
teacher-forced drafter pass (:func:`chain_predictions`) gives at every position the chain the drafter would
propose there, and the rounds follow by arithmetic. It is exact (equal counters; tested) and lets one
greedy continuation serve every k and every drafter.

The counters are vLLM's (see :mod:`eagle3lab.acceptance`). Every round counts k proposed drafts, also the
last one when its output is cut at ``max_new_tokens`` (vLLM counts what it verified, too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.aux_states.hooks import target_forward_with_aux
from eagle3lab.drafter import Eagle3Drafter, causal_mask, draft_to_target


@dataclass
class Round:
    """One verification round."""

    start: int  # index in the output of this round's first emitted token
    drafted: list[int]  # the drafts proposed (a replay knows only accepted + first rejected)
    accepted: int  # leading drafts accepted
    emitted: list[int]  # accepted drafts + the target's own token (cut at max_new_tokens / EOS)


@dataclass
class DecodeTrace:
    """What one prompt's speculative decoding produced, round by round."""

    output: list[int]
    stats: SpecDecodeStats
    rounds: list[Round] = field(default_factory=list)
    # False when ``drafted`` lists only the drafts up to the first rejection (a replay).
    complete_drafts: bool = True


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


# ---------------------------------------------------------------------------------------------------------
# verification


def verify_greedy(drafts: Sequence[int], choice: Sequence[int]) -> tuple[int, int]:
    """(accepted, the target's own token): accept while drafts equal the target's greedy ``choice``.

    ``choice[i]`` is the target's argmax after the sequence plus ``drafts[:i]`` (k + 1 entries).
    """
    a = 0
    while a < len(drafts) and drafts[a] == choice[a]:
        a += 1
    return a, int(choice[a])


def verify_sampled(
    drafts: Sequence[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Rejection sampling of one round: (accepted, the extra token).

    ``p``: [k+1, V] target probabilities after the sequence plus ``drafts[:i]``; ``q``: [k, V] the
    distributions the drafts were drawn from. Accept draft i with probability min(1, p_i(x)/q_i(x)); at the
    first rejection draw from norm(max(0, p_i - q_i)); after k acceptances draw a bonus token from p_k.
    """
    k = len(drafts)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"p has {p.shape[0]} rows and q {q.shape[0]} for {k} drafts (expected k+1 and k)")
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            continue
        resid = (p[i] - q[i]).clamp_min(0)
        # All mass cancelled only when p == q, where the draft is always accepted; guard against rounding.
        if float(resid.sum()) <= 0:
            resid = p[i]
        return i, int(torch.multinomial(resid / resid.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def _draft_chain_sampled(
    drafter: Eagle3Drafter, token_ids: torch.Tensor, aux: torch.Tensor, k: int, temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor]:
    """Drafts drawn from the drafter's softmax at ``temperature`` and their distributions q [k, V_target].

    The same chain as :meth:`Eagle3Drafter.propose` (first pass over the context, then one query per step
    that sees every first-pass key and its own chain), with a sampled token at each step.
    """
    n = token_ids.shape[0]
    dev = drafter.fc.weight.device
    hidden = drafter.combine_hidden_states(aux.to(dev))[None]
    ids = token_ids[1:].to(dev)[None]
    normed, prenorm, kv = drafter.step(ids, hidden, torch.arange(n - 1, device=dev)[None], [])
    cache = [kv]
    first = torch.ones(1, 1, n - 1, dtype=torch.bool, device=dev)
    toks: list[int] = []
    qs = []
    hidden = prenorm[:, -1:]
    last = normed[:, -1]
    for j in range(k):
        if j:
            normed, hidden, kv = drafter.step(torch.tensor([[toks[-1]]], device=dev), hidden,
                                              torch.tensor([[n - 2 + j]], device=dev), cache, first)
            cache.append(kv)
            last = normed[:, -1]
        logits = drafter.target_logits(last)[0].float() / temperature  # -inf outside the draft vocabulary
        qj = torch.softmax(logits, -1).cpu()
        toks.append(int(torch.multinomial(qj, 1, generator=generator)))
        qs.append(qj)
    return toks, torch.stack(qs)


def speculative_decode(
    model: nn.Module,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    draft_sampling: Literal["greedy", "sample"] = "greedy",
) -> DecodeTrace:
    """Chain speculative decoding of one prompt; returns the output, the counters and every round.

    Stops after exactly ``max_new_tokens`` new tokens (the last round is cut) or after emitting
    ``eos_token_id`` (included in the output). ``generator`` (CPU) drives all sampling when T > 0.
    """
    k = int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if not prompt_ids:
        raise ValueError("speculative_generate: empty prompt")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"draft_sampling {draft_sampling!r}: expected 'greedy' or 'sample'")
    stats = SpecDecodeStats(accepted_per_pos=[0] * k, accepted_hist=[0] * (k + 1))
    trace = DecodeTrace(output=[], stats=stats)
    if max_new_tokens <= 0:
        return trace
    sampled = temperature > 0
    aux_ids = drafter.config.aux_layer_ids
    dev = _device(model)

    def forward(seq: list[int]):
        return target_forward_with_aux(model, torch.tensor([seq], device=dev), aux_ids)

    def target_probs(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float().cpu() / temperature, -1)

    def done(tok: int) -> bool:
        return len(out) >= max_new_tokens or (eos_token_id is not None and tok == eos_token_id)

    # Prefill: the target's first token, and aux states for every prompt position.
    seq = list(prompt_ids)
    tgt = forward(seq)
    last = tgt.logits[0, -1]
    first_tok = int(torch.multinomial(target_probs(last), 1, generator=generator)) if sampled else int(last.argmax())
    out = trace.output
    out.append(first_tok)
    seq.append(first_tok)
    aux = tgt.aux[0]  # [len(seq) - 1, width]: positions 0..len(seq)-2
    with torch.no_grad():
        while not done(out[-1]):
            if sampled and draft_sampling == "sample":
                drafts, q = _draft_chain_sampled(drafter, torch.tensor(seq), aux, k, temperature, generator)
            else:
                drafts = drafter.propose(torch.tensor(seq), aux, k)
                q = torch.zeros(k, int(tgt.logits.shape[-1]))
                q[torch.arange(k), torch.tensor(drafts)] = 1.0  # greedy drafts: one-hot q
            n0 = len(seq)
            tgt = forward(seq + drafts)
            # The target's distribution after seq + drafts[:i] sits at position n0 - 1 + i.
            logits = tgt.logits[0, n0 - 1 : n0 + k]
            if sampled:
                a, extra = verify_sampled(drafts, target_probs(logits), q, generator)
            else:
                a, extra = verify_greedy(drafts, logits.argmax(-1).tolist())
            stats.record_round(k, a)
            rnd = Round(start=len(out), drafted=list(drafts), accepted=a, emitted=[])
            for tok in drafts[:a] + [extra]:
                out.append(tok)
                seq.append(tok)
                rnd.emitted.append(tok)
                if done(tok):
                    break
            trace.rounds.append(rnd)
            # Positions up to len(seq) - 2 hold only accepted tokens, so their aux states are exact.
            aux = tgt.aux[0, : len(seq) - 1]
    return trace


def speculative_generate(
    model: nn.Module,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], SpecDecodeStats]:
    """:func:`speculative_decode` without the rounds: (new tokens, acceptance counters)."""
    tr = speculative_decode(model, drafter, prompt_ids, num_speculative_tokens, max_new_tokens, eos_token_id,
                            temperature=temperature, generator=generator)
    return tr.output, tr.stats


# ---------------------------------------------------------------------------------------------------------
# exact greedy replay: every k and every drafter from one greedy continuation


@torch.no_grad()
def chain_predictions(drafter: Eagle3Drafter, token_ids: torch.Tensor, aux: torch.Tensor, max_k: int) -> torch.Tensor:
    """Teacher-forced draft chains at every position of one sequence: LongTensor [N-1, max_k] of target ids.

    ``token_ids``: [N] the sequence; ``aux``: [N-1 or N, width] the target's aux states (the drafter's
    features at positions 0..N-2). Row t is the chain the drafter proposes when the sequence so far is
    ``token_ids[:t+2]`` (anchor t), fed the true tokens ``token_ids[t+1+j]`` at step j: equal to
    :meth:`Eagle3Drafter.propose`'s chain for as long as its drafts are right, which is all that greedy
    acceptance looks at. Steps that would read past the sequence read token 0 (their drafts are never
    compared). Attention pattern as in training and in ``propose``: the first pass is causal, step j sees
    the first-pass keys of positions up to its anchor plus its own chain.
    """
    n = int(token_ids.shape[0])
    if n < 2:
        raise ValueError("chain_predictions: need at least 2 tokens")
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    p = n - 1
    dev = drafter.fc.weight.device
    ids = token_ids.to(dev).long()
    hidden = drafter.combine_hidden_states(aux[:p].to(dev))[None]
    anchors = torch.arange(p, device=dev)
    first = causal_mask(p, p, device=dev)[None]
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    preds = []
    for j in range(max_k):
        src = anchors + 1 + j
        tok = torch.where(src < n, ids[src.clamp(max=n - 1)], torch.zeros_like(src))[None]
        normed, hidden, kv = drafter.step(tok, hidden, (anchors + j)[None], cache, first)
        cache.append(kv)
        preds.append(draft_to_target(drafter.logits(normed[0]).argmax(-1), drafter.d2t))
    return torch.stack(preds, dim=1).cpu()


def ngram_predictions(token_ids: Sequence[int], max_k: int, max_n: int = 3, min_n: int = 1) -> torch.Tensor:
    """Prompt-lookup (n-gram copy) drafts at every position, as :func:`chain_predictions` lays them out.

    Row t: with context ``token_ids[:t+2]``, find the latest earlier occurrence of its last n tokens
    (n from ``max_n`` down to ``min_n``) and propose the ``max_k`` tokens that followed it (vLLM's
    ``ngram`` method). No match, or a copy that runs past the context: -1 (never equal to a token).
    It needs no model at all, so its acceptance measures how much of the text repeats itself.
    """
    seq = list(token_ids)
    n = len(seq)
    out = torch.full((max(n - 1, 0), max_k), -1, dtype=torch.long)
    last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end index (exclusive) of its latest occurrence
    for end in range(1, n + 1):  # context = seq[:end]; anchor t = end - 2
        t = end - 2
        if t >= 0:
            for m in range(max_n, min_n - 1, -1):
                if end - m < 0:
                    continue
                prev = last_end.get(tuple(seq[end - m : end]))
                if prev is not None:
                    copy = seq[prev : min(prev + max_k, end)]
                    out[t, : len(copy)] = torch.tensor(copy, dtype=torch.long)
                    break
        # Register the n-grams ending at `end` only now, so a lookup never finds its own occurrence.
        for m in range(min_n, max_n + 1):
            if end - m >= 0:
                last_end[tuple(seq[end - m : end])] = end
    return out


def replay_greedy(
    sequence: Sequence[int],
    prompt_len: int,
    predictions: torch.Tensor,
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> DecodeTrace:
    """The greedy decoder's rounds and counters, computed from a greedy continuation and chain predictions.

    ``sequence``: prompt + the target's greedy continuation, at least ``max_new_tokens + k`` new tokens
    long (or ending at EOS), because a round verifies drafts past the cut as the decoder does;
    ``predictions``: [len(sequence)-1, >= k] from :func:`chain_predictions` (or :func:`ngram_predictions`).
    Round drafts list only the drafts up to the first rejection (``complete_drafts`` False).
    """
    k = int(num_speculative_tokens)
    if k < 1 or predictions.shape[1] < k:
        raise ValueError(f"need k >= 1 and predictions for k={k} steps (have {predictions.shape[1]})")
    seq = list(sequence)
    if len(seq) <= prompt_len:
        raise ValueError("replay_greedy: the sequence has no generated token")
    stats = SpecDecodeStats(accepted_per_pos=[0] * k, accepted_hist=[0] * (k + 1))
    trace = DecodeTrace(output=[], stats=stats, complete_drafts=False)
    if max_new_tokens <= 0:
        return trace
    stop = len(seq)
    if eos_token_id is not None and eos_token_id in seq[prompt_len:]:
        stop = seq.index(eos_token_id, prompt_len) + 1
    out = trace.output
    out.append(seq[prompt_len])
    n = prompt_len + 1
    pred = predictions.tolist()

    def done(tok: int) -> bool:
        return len(out) >= max_new_tokens or (eos_token_id is not None and tok == eos_token_id)

    while not done(out[-1]):
        t = n - 2
        drafts = pred[t][:k]
        a = 0
        while a < k and n + a < stop and drafts[a] == seq[n + a]:
            a += 1
        if a < k and n + a >= stop and stop == len(seq):
            # Past the end of the continuation the comparison is unknown (after EOS the decoder would compare
            # with the target's choice past EOS; we stop there: a rare, documented undercount).
            raise ValueError(
                f"greedy continuation too short to replay: round at output {len(out)} needs token "
                f"{n + a - prompt_len}; generate at least max_new_tokens + k = {max_new_tokens + k} tokens"
            )
        stats.record_round(k, a)
        rnd = Round(start=len(out), drafted=drafts[: min(a + 1, k)], accepted=a, emitted=[])
        for tok in seq[n : n + a + 1]:
            out.append(tok)
            rnd.emitted.append(tok)
            if done(tok):
                break
        trace.rounds.append(rnd)
        if n + a >= len(seq) and not done(out[-1]):
            raise ValueError(
                f"greedy continuation too short to replay: generate at least max_new_tokens + k = "
                f"{max_new_tokens + k} tokens"
            )
        n += a + 1
    return trace


def aux_and_logits(model: nn.Module, sequence: Sequence[int], aux_layer_ids: Sequence[int]):
    """One target forward over ``sequence``: its :class:`~eagle3lab.aux_states.hooks.TargetOutput` (batch 1)."""
    return target_forward_with_aux(model, torch.tensor([list(sequence)], device=_device(model)), aux_layer_ids)


@dataclass
class Continuation:
    """A prompt, the target's greedy continuation and the aux states of every position."""

    prompt_len: int
    sequence: list[int]  # prompt + continuation
    aux: torch.Tensor  # [len(sequence), len(layer_ids) * H] on the CPU, ids ascending
    layer_ids: list[int]


def select_layers(aux: torch.Tensor, all_ids: Sequence[int], ids: Sequence[int], hidden_size: int) -> torch.Tensor:
    """Columns of ``ids`` (ascending, as vLLM concatenates them) from aux states stored for ``all_ids``."""
    all_ids = sorted(int(i) for i in all_ids)
    want = sorted(int(i) for i in ids)
    missing = [i for i in want if i not in all_ids]
    if missing:
        raise ValueError(f"aux ids {missing} were not stored (stored: {all_ids})")
    if aux.shape[-1] != len(all_ids) * hidden_size:
        raise ValueError(f"aux width {aux.shape[-1]} is not {len(all_ids)} layers x {hidden_size}")
    cols = [torch.arange(all_ids.index(i) * hidden_size, (all_ids.index(i) + 1) * hidden_size) for i in want]
    return aux[..., torch.cat(cols)]


@contextlib.contextmanager
def mla_expand_memo(model: nn.Module) -> Iterator[None]:
    """Within the block, each MLA attention up-projects only the cache positions it has not seen before.

    transformers 5.2x's DeepseekV3Attention caches the compressed latents and re-expands the WHOLE cache with
    ``kv_b_proj`` at every decode step (``expand_kv``), so generation costs grow with the square of the context
    (kv_lora_rank 512: 1 s per decode step at batch 64 on the CPU target). The expansion is position-wise, so
    the expansion of earlier positions can be kept; a cheap check (the first channels of every earlier latent
    unchanged) falls back to a full expansion whenever the cache is not an extension of the last call's.
    Models without ``expand_kv`` (other versions, other architectures) are left as they are.
    """
    mods = [m for m in model.modules() if callable(getattr(m, "expand_kv", None)) and hasattr(m, "kv_b_proj")]

    def memoised(orig: Any) -> Any:
        memo: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            prev = memo.get("kv")
            n = prev[0].shape[2] if prev is not None else 0
            if (prev is not None and prev[0].shape[0] == kv_nope.shape[0] and n < kv_nope.shape[2]
                    and torch.equal(prev[2], kv_nope[:, :, :n, :4])):
                k_new, v_new = orig(kv_nope[:, :, n:], k_rot[:, :, n:])
                k, v = torch.cat([prev[0], k_new], 2), torch.cat([prev[1], v_new], 2)
            else:
                k, v = orig(kv_nope, k_rot)
            memo["kv"] = (k, v, kv_nope[..., :4].clone())
            return k, v

        return expand_kv

    # An instance attribute shadows the class method; restore exactly what was there, so that blocks nest
    # (the reference engine memoises its own generate calls, and callers may wrap them again).
    saved = [m.__dict__.get("expand_kv") for m in mods]
    for m in mods:
        m.expand_kv = memoised(m.expand_kv)
    try:
        yield
    finally:
        for m, prev in zip(mods, saved, strict=True):
            if prev is None:
                del m.expand_kv
            else:
                m.expand_kv = prev


def greedy_continuations(
    engine: Any, prompts: Sequence[Sequence[int]], num_tokens: int, layer_ids: Sequence[int], batch_size: int = 16
) -> list[Continuation]:
    """Greedy continuations of ``num_tokens`` (``engine.generate``, batched) and one forward over each for aux.

    ``engine`` must hold the transformers model in-process (the reference engine). For an exact replay of
    decoding with up to k drafts and ``max_new_tokens``, ask ``num_tokens = max_new_tokens + k``.
    """
    if not hasattr(engine, "model"):
        raise ValueError("greedy_continuations needs an in-process model (the reference engine)")
    ids = sorted(int(i) for i in layer_ids)
    out: list[Continuation] = []
    for b in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[b : b + batch_size]]
        with mla_expand_memo(engine.model):
            gens = engine.generate(batch, num_tokens)
        for p, gen in zip(batch, gens, strict=True):
            seq = p + list(gen)
            aux = aux_and_logits(engine.model, seq, ids).aux[0].float().cpu()
            out.append(Continuation(prompt_len=len(p), sequence=seq, aux=aux, layer_ids=ids))
    return out


def replay_drafter(
    drafter: Eagle3Drafter | None,
    continuations: Sequence[Continuation],
    k_values: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    hidden_size: int | None = None,
) -> dict[int, list[DecodeTrace]]:
    """Greedy rounds of ``drafter`` on every continuation for every k (``drafter`` None: prompt lookup).

    One teacher-forced chain per continuation serves all k. Returns ``{k: [trace per continuation]}``.
    """
    max_k = max(k_values)
    res: dict[int, list[DecodeTrace]] = {k: [] for k in k_values}
    for c in continuations:
        if drafter is None:
            preds = ngram_predictions(c.sequence, max_k)
        else:
            h = hidden_size or drafter.config.target_hidden_size
            aux = select_layers(c.aux, c.layer_ids, drafter.config.aux_layer_ids, h)
            preds = chain_predictions(drafter, torch.tensor(c.sequence), aux[: len(c.sequence) - 1], max_k)
        for k in k_values:
            res[k].append(replay_greedy(c.sequence, c.prompt_len, preds, k, max_new_tokens, eos_token_id))
    return res


@torch.no_grad()
def forward_cost_ratio(
    model: nn.Module, drafter: Eagle3Drafter, sequence: Sequence[int], repeats: int = 20
) -> tuple[float, float, float]:
    """(drafter step seconds, target decode-step seconds, their ratio), medians over ``repeats``.

    Both are timed as one decode step after ``sequence`` (the target with its KV cache, the drafter with its
    first-pass cache, as in ``propose``): the cost of one draft against one target forward. Wall time on
    this machine (CUDA synchronised); small models on a GPU are launch-bound, so the ratio is machine-specific.
    """
    import copy
    import statistics
    import time

    seq = list(sequence)
    if len(seq) < 3:
        raise ValueError("forward_cost_ratio: need a sequence of at least 3 tokens")
    dev = _device(model)
    ids = torch.tensor([seq], device=dev)
    pre = model(input_ids=ids[:, :-1], use_cache=True)
    # transformers 5.2x names the KV cache ``cache``; earlier versions ``past_key_values``.
    cache_kw = "cache" if pre.get("cache") is not None else "past_key_values"
    cache = pre[cache_kw]
    aux = target_forward_with_aux(model, ids[:, :-1], drafter.config.aux_layer_ids).aux[0]
    n = len(seq) - 1
    ddev = drafter.fc.weight.device
    hidden = drafter.combine_hidden_states(aux.to(ddev))[None]
    _, prenorm, kv = drafter.step(torch.tensor([seq[1:n + 1]], device=ddev), hidden,
                                  torch.arange(n, device=ddev)[None], [])
    first = torch.ones(1, 1, n, dtype=torch.bool, device=ddev)
    tok = torch.tensor([[seq[-1]]], device=ddev)
    def sync() -> None:  # CUDA kernels run asynchronously: wait for them before reading the clock
        for d in {dev, ddev}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    t_target, t_draft = [], []
    for _ in range(repeats):
        past = {cache_kw: copy.deepcopy(cache)}  # a decode step appends to the cache: time a fresh copy
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids[:, -1:], use_cache=True, **past)
        sync()
        t_target.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        normed, _, _ = drafter.step(tok, prenorm[:, -1:], torch.tensor([[n]], device=ddev), [kv], first)
        drafter.logits(normed).argmax(-1)
        sync()
        t_draft.append(time.perf_counter() - t0)
    d, t = statistics.median(t_draft), statistics.median(t_target)
    return d, t, d / t
