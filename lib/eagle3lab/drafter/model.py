"""The EAGLE-3 drafter module that is, weight for weight and op for op, vLLM 0.26.0's ``Eagle3LlamaForCausalLM``.

The shapes, names and math follow ``vllm/model_executor/models/llama_eagle3.py`` (read in the installed
wheel), because 05_acceptance on a GPU host loads what we save here into vLLM:

    g      = fc(aux)                                     aux: [.., n_aux * H_target] -> [.., H]
    e      = input_layernorm(embed(token))                the token drafted (or sampled) last
    h, r   = hidden_norm(g), g                            (norm_before_residual=False: residual is raw)
    x      = attn([e ; h]) + r                            q/k/v take 2H inputs, one Llama layer
    y      = mlp(post_attention_layernorm(x)) + x
    logits = lm_head(norm(y))                             over the draft vocabulary
    next hidden for the following draft step = y          (vLLM feeds back the pre-norm state)

Draft-vocabulary logits map back to target ids with ``target = i + d2t[i]``; ``t2d`` is a bool mask over
the target vocabulary (vLLM ignores it when loading; we keep it for training).

Attention has one twist that lets the same code run training-time test (TTT) and decoding: a call
attends *causally* to the keys of the first (feature-driven) pass, and to the *diagonal* of every later
draft step. A draft chain anchored at position t thus sees the target-feature keys 0..t plus its own
earlier draft keys, which is exactly what vLLM's KV cache holds when it drafts step j for that anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3lab.aux_layers import check_aux_layer_ids
from eagle3lab.drafter.vocab import build_draft_vocab, draft_to_target

# ----------------------------------------------------------------------------------------------------
# config


@dataclass
class DrafterConfig:
    """Everything that fixes the drafter's shapes; saved as the speculators ``transformer_layer_config``."""

    vocab_size: int  # the target's vocabulary (embeddings, and what d2t maps into)
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    intermediate_size: int
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # vLLM's speculators loader defaults this to True when absent; we always write it explicitly.
    norm_before_residual: bool = False
    # True: embeddings are the target's (same width), frozen and not saved; vLLM then shares the target's.
    shared_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        # The rules (and the ascending order vLLM returns the states in) are aux_layers'; the drafter does
        # not know the target's depth, so the range is checked where it is known (params, capture, lint).
        self.aux_layer_ids = check_aux_layer_ids(self.aux_layer_ids)
        if self.shared_embeddings and self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"shared embeddings need the drafter width ({self.hidden_size}) to equal the target's "
                f"({self.target_hidden_size}); use shared_embeddings=False"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in 1..{self.vocab_size}")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)


# ----------------------------------------------------------------------------------------------------
# building blocks (vLLM's RMSNorm, neox-style rotary, Llama MLP)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 like vLLM's kernel, whatever the storage dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (first half / second half pairs), as vLLM's Llama uses.

    x: [B, heads, T, D]; positions: [B, T] (absolute positions; draft step j of the chain anchored at t
    sits at t + j).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding ; hidden] input."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        d_in = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        first_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend; return the output and this call's (k, v) for the caller to append to ``cache``.

        cache[0] holds the first pass's keys/values (attended through ``first_mask``: [B, Tq, Tk0] bool,
        True = visible, None = causal aligned to the end); cache[1:] hold later draft steps, each of the
        query's own length, attended only on the diagonal (same anchor). With an empty cache this call
        *is* the first pass.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
        rep = self.n_heads // self.n_kv
        scale = self.head_dim**-0.5

        k0, v0 = cache[0] if cache else (k, v)
        diag = [*cache[1:], (k, v)] if cache else []
        k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
        scores = [torch.matmul(q, k0.transpose(-1, -2)) * scale]  # [B, h, Tq, Tk0]
        if first_mask is None:
            first_mask = causal_mask(t, k0.shape[2], device=x.device)[None]
        scores[0] = scores[0].masked_fill(~first_mask[:, None], float("-inf"))
        for kd, _ in diag:
            scores.append((q * kd.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale)  # [B, h, Tq, 1]
        probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        tk0 = k0.shape[2]
        out = torch.matmul(probs[..., :tk0], v0)
        for i, (_, vd) in enumerate(diag):
            out = out + probs[..., tk0 + i : tk0 + i + 1] * vd.repeat_interleave(rep, 1)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v)


def causal_mask(tq: int, tk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[tq, tk] bool, query i sees keys 0..i + (tk - tq) (queries are the last tq positions)."""
    qi = torch.arange(tq, device=device)[:, None] + (tk - tq)
    return torch.arange(tk, device=device)[None, :] <= qi


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's Eagle3 ``LlamaDecoderLayer`` with layer_idx 0 (the only layer)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, positions, cache, first_mask):
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        attn, kv = self.self_attn(torch.cat([embeds, hidden], dim=-1), positions, cache, first_mask)
        # vLLM fuses "add residual, then norm"; the sum becomes the new residual.
        residual = attn + residual
        out = self.mlp(self.post_attention_layernorm(residual))
        return out, residual, kv


# ----------------------------------------------------------------------------------------------------
# the drafter


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter; parameter names equal the checkpoint names vLLM 0.26.0 loads."""

    def __init__(self, cfg: DrafterConfig, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.shared_embeddings:
            # The target's embeddings: loaded by the caller, never trained, never saved.
            self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if d2t is None or t2d is None:
            # Identity-like default: the first draft_vocab_size target ids.
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[: cfg.draft_vocab_size] = True
        self._check_vocab_maps(d2t, t2d)
        self.register_buffer("d2t", d2t.clone().long())
        self.register_buffer("t2d", t2d.clone().bool())
        self.apply(self._init_weights)

    def _check_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        cfg = self.config
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise ValueError(
                f"d2t/t2d shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not match draft vocab "
                f"{cfg.draft_vocab_size} / target vocab {cfg.vocab_size}"
            )
        if int(t2d.sum()) != cfg.draft_vocab_size:
            raise ValueError(f"t2d marks {int(t2d.sum())} tokens, expected draft_vocab_size {cfg.draft_vocab_size}")
        if not torch.equal(d2t + torch.arange(cfg.draft_vocab_size), torch.nonzero(t2d).flatten()):
            raise ValueError("d2t and t2d describe different draft vocabularies")

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    # -- the math ----------------------------------------------------------------------------------

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states ([.., n_aux*H_target] -> [.., H])."""
        expect = self.fc.in_features
        if aux.shape[-1] != expect:
            raise ValueError(
                f"aux width {aux.shape[-1]} does not match the drafter's fc input {expect} "
                f"({self.config.num_aux} aux layers x target hidden {self.config.target_hidden_size})"
            )
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        first_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One drafter forward: (post-norm state for logits, pre-norm state to feed back, this step's k/v)."""
        embeds = self.embed_tokens(input_ids)
        out, residual, kv = self.layers[0](embeds, hidden, positions, cache, first_mask)
        prenorm = out + residual
        return self.norm(prenorm), prenorm, kv

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., draft_vocab]."""
        return self.lm_head(normed)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, -inf outside the draft vocabulary (vLLM's compute_logits)."""
        dl = self.logits(normed)
        out = dl.new_full((*dl.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., draft_to_target(torch.arange(self.config.draft_vocab_size, device=dl.device), self.d2t)] = dl
        return out

    @torch.no_grad()
    def propose(
        self, token_ids: torch.Tensor, aux: torch.Tensor, num_tokens: int
    ) -> list[int]:
        """Greedy chain of ``num_tokens`` draft tokens (target ids) for one sequence.

        token_ids: [N] the sequence so far (the last one is the target's newest token, with no aux yet);
        aux: [N-1, n_aux*H_target], the target's aux states at positions 0..N-2. The first pass reads
        (token t+1, features t) at positions t = 0..N-2, exactly vLLM's drafter prefill; each further
        step feeds the drafted token and the pre-norm state back at the next position.
        """
        n = token_ids.shape[0]
        if aux.shape[0] != n - 1:
            raise ValueError(f"aux has {aux.shape[0]} positions, expected len(token_ids) - 1 = {n - 1}")
        dev = self.fc.weight.device
        hidden = self.combine_hidden_states(aux.to(dev))[None]
        ids = token_ids[1:].to(dev)[None]
        pos = torch.arange(n - 1, device=dev)[None]
        normed, prenorm, kv = self.step(ids, hidden, pos, [])
        cache = [kv]
        tok = draft_to_target(self.logits(normed[:, -1]).argmax(-1), self.d2t)  # [1]
        out = [int(tok)]
        hidden, p = prenorm[:, -1:], n - 2
        # Later steps: one query each; it sees all first-pass keys (mask all True) plus the chain's own keys.
        first = torch.ones(1, 1, n - 1, dtype=torch.bool, device=dev)
        for j in range(1, num_tokens):
            normed, hidden, kv = self.step(tok[None], hidden, torch.tensor([[p + j]], device=dev), cache, first)
            cache.append(kv)
            tok = draft_to_target(self.logits(normed[:, -1]).argmax(-1), self.d2t)
            out.append(int(tok))
        return out

    # -- helpers -----------------------------------------------------------------------------------

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameter count (shared embeddings excluded when ``trainable_only``)."""
        ps = self.trainable_parameters() if trainable_only else list(self.parameters())
        return sum(p.numel() for p in ps)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors as vLLM expects them in model.safetensors (no embeddings when shared)."""
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.shared_embeddings:
            sd.pop("embed_tokens.weight")
        return sd


# ----------------------------------------------------------------------------------------------------
# construction from a target


def make_drafter_config(
    target_config: Any,
    aux_layer_ids: Sequence[int],
    draft_vocab_size: int,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
) -> DrafterConfig:
    """A drafter config sized from a target's HF config (an object or a dict).

    Heads default to :func:`default_drafter_heads`: vLLM's attention backends take the head_dim of
    published drafters (128) and may route unusual ones (e.g. 512) to kernels that are not installed.
    """
    get = (lambda k, d=None: target_config.get(k, d)) if isinstance(target_config, dict) else (
        lambda k, d=None: getattr(target_config, k, d)
    )
    if get("text_config") is not None:  # multimodal wrappers (Kimi-K2.5) keep the LM config inside
        tc = get("text_config")
        return make_drafter_config(
            tc, aux_layer_ids, draft_vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads
        )
    th = int(get("hidden_size"))
    h = hidden_size or th
    rope = get("rope_parameters") or {}
    theta = float((rope.get("rope_theta") if isinstance(rope, dict) else None) or get("rope_theta") or 10000.0)
    if intermediate_size is None:
        intermediate_size = int(get("intermediate_size")) if h == th and get("intermediate_size") else 4 * h
    if num_attention_heads is None:
        num_attention_heads = default_drafter_heads(h, get("num_attention_heads"))
    if num_key_value_heads is None:
        num_key_value_heads = num_attention_heads
    return DrafterConfig(
        vocab_size=int(get("vocab_size")),
        draft_vocab_size=draft_vocab_size,
        hidden_size=h,
        target_hidden_size=th,
        aux_layer_ids=list(aux_layer_ids),
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        rms_norm_eps=float(get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        max_position_embeddings=int(get("max_position_embeddings") or 2048),
        shared_embeddings=(h == th),
    )


def default_drafter_heads(hidden_size: int, target_heads: int | None = None) -> int:
    """Heads for a drafter of width ``hidden_size``, as published drafters size them.

    The largest divisor of the target's head count that gives a head_dim of 64-256 in multiples of 8
    (what vLLM's FlashAttention paths take, and a count that tensor parallelism can still split):
    SpecForge's Kimi-K2.5 drafter keeps Kimi's 64 heads at 7168 (head_dim 112). Without a target head
    count, head_dim 128. A drafter with 4 heads at width 2048 (head_dim 512) was routed by vLLM 0.26 to
    a CuTe kernel that is not installed (seen on an H200, 2026-11-29).
    """
    def fits(n: int) -> bool:
        return n >= 1 and hidden_size % n == 0 and 64 <= hidden_size // n <= 256 and (hidden_size // n) % 8 == 0

    if target_heads:
        for n in range(int(target_heads), 0, -1):
            if int(target_heads) % n == 0 and fits(n):
                return n
    if hidden_size % 128 == 0:
        return hidden_size // 128
    return 1


def init_from_target(
    drafter: Eagle3Drafter, embed_weight: torch.Tensor | None, lm_head_weight: torch.Tensor | None = None
) -> Eagle3Drafter:
    """Copy the target's embeddings (shared case) and its lm_head rows of the draft vocabulary.

    Starting the draft lm_head from the target's rows is a cheap head start when widths match; it is
    trained afterwards. Shapes are checked so a wrong target fails here, not in a matmul later.
    """
    cfg = drafter.config
    with torch.no_grad():
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"target embeddings {tuple(embed_weight.shape)} do not fit the drafter "
                    f"({cfg.vocab_size}, {cfg.hidden_size})"
                )
            drafter.embed_tokens.weight.copy_(embed_weight)
        elif cfg.shared_embeddings:
            raise ValueError("shared embeddings: the target's embed_tokens weight is required")
        if lm_head_weight is not None and lm_head_weight.shape[-1] == cfg.hidden_size:
            rows = torch.nonzero(drafter.t2d).flatten()
            drafter.lm_head.weight.copy_(lm_head_weight[rows.to(lm_head_weight.device)])
    return drafter


def build_drafter(
    target_config: Any,
    aux_layer_ids: Sequence[int],
    token_counts: torch.Tensor,
    draft_vocab_size: int,
    embed_weight: torch.Tensor | None,
    lm_head_weight: torch.Tensor | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    seed: int = 0,
) -> Eagle3Drafter:
    """A fresh drafter for a target: draft vocab from token counts, embeddings/lm_head from the target."""
    cfg = make_drafter_config(
        target_config, aux_layer_ids, draft_vocab_size, hidden_size, intermediate_size,
        num_attention_heads, num_key_value_heads,
    )
    if token_counts.numel() != cfg.vocab_size:
        raise ValueError(f"token_counts has {token_counts.numel()} entries, target vocabulary is {cfg.vocab_size}")
    d2t, t2d = build_draft_vocab(token_counts, draft_vocab_size)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, d2t, t2d)
    return init_from_target(
        drafter, embed_weight if cfg.shared_embeddings else None, lm_head_weight if cfg.shared_embeddings else None
    )



def describe(drafter: Eagle3Drafter) -> dict[str, Any]:
    """A small summary for tables: widths, aux ids, vocabularies, parameter counts."""
    c = drafter.config
    return {
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_layer_ids": c.aux_layer_ids,
        "draft_vocab_size": c.draft_vocab_size,
        "target_vocab_size": c.vocab_size,
        "shared_embeddings": c.shared_embeddings,
        "params_total": drafter.num_parameters(),
        "params_trainable": drafter.num_parameters(trainable_only=True),
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "fc_in": c.num_aux * c.target_hidden_size,
    }
