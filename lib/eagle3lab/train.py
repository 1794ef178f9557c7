"""EAGLE-3 drafter training with training-time test (TTT), resumable bit for bit.

Alignment (vLLM's convention). For a sequence x_0..x_{T-1} with target features f_t (the aux states at
position t, which the target used to predict x_{t+1}), anchor position t runs a chain of drafts:

    step 0: token x_{t+1}, hidden fc(f_t),               rotary position t     -> predicts x_{t+2}
    step j: token x_{t+1+j}, hidden = step j-1's pre-norm output at anchor t,
            rotary position t + j                                               -> predicts x_{t+2+j}

(Indexed by absolute position, step j at position t+j reads the drafter's own output of step j-1 at
position t+j-1 with the token input shifted once more: the same thing.)

Why the standard EAGLE-3 formulation (accumulated keys, causal over the first pass and diagonal over the
later steps) rather than the "unrolled" one that re-runs a causal pass over shifted inputs: at inference
vLLM's drafter KV cache holds exactly the first-pass keys of positions 0..t plus the chain's own draft
keys, so this trains the model in the attention pattern it is used in; the unrolled variant would let
step j attend to other anchors' draft states that never exist at inference.

Tokens are teacher-forced (ground truth x_{t+1+j}), hidden states are the drafter's own: when a draft is
wrong vLLM rejects everything after it, so only the correct-token case matters for acceptance.

Loss: cross-entropy over the draft vocabulary on response tokens (loss_mask) only; target tokens outside
the draft vocabulary are IGNORED in the loss (the drafter cannot emit them) but COUNTED AS WRONG in the
accuracy, so the accuracy is an honest proxy for acceptance. Total = sum_j decay^j * loss_j.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from eagle3lab import provenance
from eagle3lab.drafter import (
    Eagle3Drafter,
    VocabCoverage,
    build_drafter,
    causal_mask,
    target_embedding_weights,
    target_to_draft,
    vocab_coverage,
)
from eagle3lab.errors import CorruptFileError
from eagle3lab.progress import progress as progress_bar

log = logging.getLogger(__name__)

CKPT_NAME = "last.pt"


@dataclass
class TrainResult:
    """What a training run produced (whole history, also across resumes)."""

    losses: list[float] = field(default_factory=list)  # total weighted loss per optimizer step
    step_losses: list[list[float]] = field(default_factory=list)  # [step][ttt position]
    accuracies: list[list[float]] = field(default_factory=list)  # [step][ttt position]
    seconds: float = 0.0
    steps: int = 0
    total_steps: int = 0
    resumed_from: int = 0

    @property
    def final_loss(self) -> float:
        """Mean total loss over the last 10% of steps (at least one)."""
        return _tail_mean(self.losses)

    @property
    def final_accuracy(self) -> list[float]:
        """Per-TTT-position accuracy averaged over the last 10% of steps."""
        if not self.accuracies:
            return []
        k = len(self.accuracies[0])
        return [_tail_mean([a[i] for a in self.accuracies]) for i in range(k)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["final_loss"], d["final_accuracy"] = self.final_loss, self.final_accuracy
        return d


def _tail_mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return float("nan")
    n = max(1, len(xs) // 10)
    return sum(xs[-n:]) / n


# ----------------------------------------------------------------------------------------------------
# batching


def collate(samples: Sequence[dict[str, torch.Tensor]], max_seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples {input_ids, loss_mask, aux} into a batch with a ``valid`` padding mask."""
    if not samples:
        raise ValueError("collate: empty batch")
    trunc = [
        {k: s[k][:max_seq_len] if max_seq_len else s[k] for k in ("input_ids", "loss_mask", "aux")} for s in samples
    ]
    t = max(s["input_ids"].shape[0] for s in trunc)
    width = trunc[0]["aux"].shape[-1]
    b = len(trunc)
    ids = torch.zeros(b, t, dtype=torch.long)
    lm = torch.zeros(b, t, dtype=torch.bool)
    valid = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, width, dtype=torch.float32)
    for i, s in enumerate(trunc):
        n = s["input_ids"].shape[0]
        if s["aux"].shape != (n, width):
            raise ValueError(f"sample {i}: aux shape {tuple(s['aux'].shape)} does not match ({n}, {width})")
        ids[i, :n] = s["input_ids"]
        lm[i, :n] = s["loss_mask"].bool()
        valid[i, :n] = True
        aux[i, :n] = s["aux"].float()
    return {"input_ids": ids, "loss_mask": lm, "valid": valid, "aux": aux}


def token_counts_from_dataset(dataset: Any, vocab_size: int, response_only: bool = True) -> torch.Tensor:
    """Token frequencies over a dataset of {input_ids, loss_mask, ...} items, for the draft vocabulary.

    ``response_only`` counts only loss-mask tokens: the drafter predicts responses, not prompts.
    """
    if len(dataset) == 0:
        raise ValueError("token_counts_from_dataset: the dataset is empty")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(dataset)):
        # HiddenStateDataset.get can skip reading the aux states, which dominate the bytes.
        item = dataset.get(i, ("input_ids", "loss_mask")) if hasattr(dataset, "get") else dataset[i]
        ids = item["input_ids"][item["loss_mask"].bool()] if response_only else item["input_ids"]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"item {i}: token id {int(ids.max())} outside the vocabulary of {vocab_size}")
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    return counts


# ----------------------------------------------------------------------------------------------------
# the TTT loss


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    ttt_steps: int,
    ttt_decay: float,
) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted TTT loss of one batch: (total, per-step losses, per-step accuracies).

    See the module docstring for the alignment. Positions are anchors t = 0..T-2 (the last token has no
    next token to feed).
    """
    ids, aux, valid, lmask = batch["input_ids"], batch["aux"], batch["valid"], batch["loss_mask"]
    b, t = ids.shape
    if t < 3:
        raise ValueError(f"sequences of {t} tokens are too short for drafter training (need at least 3)")
    dev = drafter.fc.weight.device
    ids, aux, valid, lmask = ids.to(dev), aux.to(dev), valid.to(dev), lmask.to(dev)
    p = t - 1
    anchors = torch.arange(p, device=dev)

    def shifted(x: torch.Tensor, s: int, fill: Any) -> torch.Tensor:
        # x[:, anchor + s] for every anchor, ``fill`` past the end.
        out = torch.full((b, p), fill, dtype=x.dtype, device=dev)
        if s < t:
            n = min(p, t - s)
            out[:, :n] = x[:, s : s + n]
        return out

    key_valid = shifted(valid, 1, False)  # first-pass key t exists iff token x_{t+1} does
    eye = torch.eye(p, dtype=torch.bool, device=dev)
    first_mask = causal_mask(p, p, device=dev)[None] & (key_valid[:, None, :] | eye[None])

    hidden = drafter.combine_hidden_states(aux[:, :p])
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = torch.zeros((), device=dev)
    losses, accs = [], []
    for j in range(ttt_steps):
        tok_in = shifted(ids, 1 + j, 0)
        target = shifted(ids, 2 + j, 0)
        in_loss = shifted(lmask, 2 + j, False) & shifted(valid, 2 + j, False)
        pos = (anchors + j)[None].expand(b, p)
        normed, hidden, kv = drafter.step(tok_in, hidden, pos, cache, first_mask)
        cache.append(kv)
        logits = drafter.logits(normed).float()
        tgt_draft = target_to_draft(target, drafter.t2d, missing=-100)
        use = in_loss & (tgt_draft >= 0)
        labels = torch.where(use, tgt_draft, torch.full_like(tgt_draft, -100))
        if use.any():
            loss_j = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        else:
            loss_j = logits.sum() * 0.0  # keeps the graph; nothing to learn in this step
        total = total + (ttt_decay**j) * loss_j
        with torch.no_grad():
            pred = logits.argmax(-1)
            correct = (pred == tgt_draft) & use
            n = int(in_loss.sum())
            accs.append(float(correct.sum()) / n if n else float("nan"))
            losses.append(float(loss_j.detach()))
    return total, losses, accs


# ----------------------------------------------------------------------------------------------------
# the training loop


def lr_at(step: int, total_steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _batch_indices(n: int, batch_size: int, epoch: int, seed: int) -> list[list[int]]:
    # The order depends only on (seed, epoch): a resumed run recomputes the same batches.
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


CKPT_KEYS = ("model", "optimizer", "step", "rng", "result")


def _read_checkpoint(path: Path, device: str | torch.device) -> dict[str, Any]:
    """The training checkpoint at ``path``; a file torch cannot read, or one without a checkpoint's keys, is a
    CorruptFileError naming it (torch's own message names no file and comes from deep inside its reader)."""
    remedy = "delete it to train from scratch"
    try:
        ck = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - zip, pickle, EOF and safetensors errors all mean the same here
        raise CorruptFileError(path, "drafter training checkpoint", exc, remedy) from None
    if not isinstance(ck, dict) or not all(k in ck for k in CKPT_KEYS):
        raise CorruptFileError(path, "drafter training checkpoint", f"expected the keys {list(CKPT_KEYS)}", remedy)
    return ck


def _fingerprint(drafter: Eagle3Drafter, dataset: Any, **hp: Any) -> dict[str, Any]:
    # What must not change between an interrupted run and its resume: the drafter's shape, the settings,
    # and the data (a HiddenStateDataset's fingerprint names the samples and the target it came from).
    return {"drafter_config": asdict(drafter.config), "data": getattr(dataset, "fingerprint", None), **hp}


def train_drafter(
    drafter: Eagle3Drafter,
    dataset: Any,
    ttt_steps: int = 3,
    ttt_decay: float = 0.8,
    epochs: int = 1,
    max_steps: int | None = None,
    batch_size: int = 8,
    lr: float = 1e-3,
    warmup: int = 20,
    weight_decay: float = 0.0,
    max_seq_len: int | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    resume: bool = True,
    stop_after: int | None = None,
    on_mismatch: str = "refuse",
) -> TrainResult:
    """Train ``drafter`` in place on ``dataset`` (items {input_ids, loss_mask, aux}) with TTT.

    The schedule has ``min(max_steps, epochs * ceil(len/batch_size))`` optimizer steps. With a
    ``checkpoint_dir`` the model, optimizer, step, history and RNG state are written atomically every
    ``checkpoint_every`` steps and at the end; with ``resume`` an existing checkpoint is continued (the
    result equals an uninterrupted run). ``stop_after`` ends the run after that global step (after
    checkpointing), as an interruption would: for tests and time budgets.

    A checkpoint written for another drafter, other settings or other data (the dataset's
    ``fingerprint``: samples and target) is never resumed: ``on_mismatch="refuse"`` raises ValueError
    naming what changed, ``"restart"`` logs it and trains from scratch.
    """
    if on_mismatch not in ("refuse", "restart"):
        raise ValueError(f"on_mismatch {on_mismatch!r}: expected 'refuse' or 'restart'")
    n = len(dataset)
    if n == 0:
        raise ValueError("train_drafter: the dataset is empty (no sequences to train on)")
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    width = drafter.fc.in_features
    # a stored dataset says its width; reading an item would cost an online dataset a target forward
    ids_attr, hidden_attr = getattr(dataset, "aux_layer_ids", None), getattr(dataset, "hidden_size", None)
    have = len(ids_attr) * int(hidden_attr) if ids_attr is not None and hidden_attr is not None \
        else dataset[0]["aux"].shape[-1]
    if have != width:
        raise ValueError(
            f"dataset aux width {have} does not match the drafter's fc input {width} "
            f"({drafter.config.num_aux} aux layers x target hidden {drafter.config.target_hidden_size}); "
            "were the hidden states extracted for other aux layers or another target?"
        )
    if ids_attr is not None and sorted(ids_attr) != drafter.config.aux_layer_ids:
        raise ValueError(f"dataset aux_layer_ids {list(ids_attr)} differ from the drafter's {drafter.config.aux_layer_ids}")

    steps_per_epoch = math.ceil(n / batch_size)
    total_steps = epochs * steps_per_epoch
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    drafter.to(device).train()
    params = drafter.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    fp = _fingerprint(
        drafter, dataset, ttt_steps=ttt_steps, ttt_decay=ttt_decay, batch_size=batch_size, lr=lr, warmup=warmup,
        weight_decay=weight_decay, total_steps=total_steps, seed=seed, n=n, max_seq_len=max_seq_len,
    )
    result = TrainResult(total_steps=total_steps)
    step = 0
    ckpt_path = Path(checkpoint_dir) / CKPT_NAME if checkpoint_dir else None
    if ckpt_path is not None:
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    if ckpt_path is not None and resume and ckpt_path.is_file():
        ck = _read_checkpoint(ckpt_path, device)
        stale = provenance.changed(ck.get("fingerprint"), fp)
        if stale and on_mismatch == "refuse":
            raise ValueError(
                f"checkpoint {ckpt_path} was written by a run with other settings or data ({', '.join(stale)} "
                "changed); delete it, pass resume=False or on_mismatch='restart'"
            )
        if stale:
            log.warning("%s: written for other inputs (%s changed): training from scratch", ckpt_path, ", ".join(stale))
            ck = None
    else:
        ck = None
    if ck is not None:
        drafter.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        torch.set_rng_state(ck["rng"].cpu())  # map_location may have moved it to the GPU
        step = ck["step"]
        result = TrainResult(**ck["result"])
        result.resumed_from = step
    else:
        torch.manual_seed(seed)

    def save() -> None:
        if ckpt_path is None:
            return
        _atomic_save(
            {
                "model": drafter.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "rng": torch.get_rng_state(),
                "result": asdict(result),
                "fingerprint": fp,
            },
            ckpt_path,
        )

    t0 = time.perf_counter() - result.seconds
    bar = progress_bar(total=total_steps, initial=step, desc="drafter TTT", disable=not progress)
    epoch_batches: dict[int, list[list[int]]] = {}
    while step < total_steps:
        epoch, i = divmod(step, steps_per_epoch)
        if epoch not in epoch_batches:
            epoch_batches = {epoch: _batch_indices(n, batch_size, epoch, seed)}
        idx = epoch_batches[epoch][i]
        # an online dataset (eagle3lab.aux_states.online) computes a whole batch's aux states in one forward
        items = dataset.get_batch(idx) if hasattr(dataset, "get_batch") else [dataset[j] for j in idx]
        batch = collate(items, max_seq_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, lr, warmup)
        loss, step_losses, accs = ttt_loss(drafter, batch, ttt_steps, ttt_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        result.losses.append(float(loss.detach()))
        result.step_losses.append(step_losses)
        result.accuracies.append(accs)
        result.steps = step
        result.seconds = time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}", acc0=f"{accs[0]:.2f}")
        if step % checkpoint_every == 0 or step in (total_steps, stop_after):
            save()
        if stop_after is not None and step >= stop_after:
            break
    bar.close()
    drafter.eval()
    return result


# ----------------------------------------------------------------------------------------------------
# figures


def _smooth(xs: Sequence[float], window: int) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > window:
            acc.pop(0)
        vals = [a for a in acc if not math.isnan(a)]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def loss_figure(result: TrainResult, smooth: int = 10) -> go.Figure:
    """Total TTT loss and each position's loss per optimizer step (moving average over ``smooth`` steps)."""
    x = list(range(1, len(result.losses) + 1))
    fig = go.Figure()
    fig.add_scatter(x=x, y=_smooth(result.losses, smooth), name="total (weighted)", line={"width": 3})
    k = len(result.step_losses[0]) if result.step_losses else 0
    for j in range(k):
        fig.add_scatter(x=x, y=_smooth([s[j] for s in result.step_losses], smooth), name=f"TTT step {j + 1}")
    fig.update_layout(title="Drafter training loss", xaxis_title="optimizer step", yaxis_title="cross-entropy")
    return fig


def accuracy_figure(result: TrainResult, smooth: int = 10) -> go.Figure:
    """Top-1 accuracy of each TTT position on response tokens during training (moving average)."""
    x = list(range(1, len(result.accuracies) + 1))
    fig = go.Figure()
    k = len(result.accuracies[0]) if result.accuracies else 0
    for j in range(k):
        fig.add_scatter(x=x, y=_smooth([a[j] for a in result.accuracies], smooth), name=f"draft position {j + 1}")
    fig.update_layout(
        title="Drafter training accuracy per draft position", xaxis_title="optimizer step",
        yaxis={"title": "top-1 accuracy", "range": [0, 1]},
    )
    return fig


def accuracy_summary(accuracies: Sequence[float], flat: float = 0.02, low: float = 0.2) -> str:
    """One sentence that describes per-position accuracies as they are (for the notebook's narrative).

    Falls / rises when the last position differs from the first by more than ``flat``; "nearly flat"
    otherwise; and "low at every position" when even the best is below ``low`` (then the shape says
    nothing about compounding errors, only that the drafter learned little).
    """
    acc = [a for a in accuracies if not math.isnan(a)]
    if not acc:
        return "no accuracy was measured (no response tokens in the training data)"
    shown = " / ".join(f"{a:.3f}" for a in acc)
    if max(acc) < low:
        return f"accuracy is low at every position ({shown}): too little training to say how positions compare"
    if acc[0] - acc[-1] > flat:
        return (f"accuracy falls from {acc[0]:.3f} at position 1 to {acc[-1]:.3f} at position {len(acc)} "
                f"({shown}): the drafter's own states serve later positions less well than the target's features")
    if acc[-1] - acc[0] > flat:
        return (f"accuracy rises from {acc[0]:.3f} at position 1 to {acc[-1]:.3f} at position {len(acc)} "
                f"({shown}): later positions are easier on this data")
    return (f"accuracy is nearly flat across positions ({shown}): on this data the drafter's own states serve "
            "later positions about as well as the target's features serve the first")


# ----------------------------------------------------------------------------------------------------
# a target folder + hidden states -> a drafter (04_train_drafter, and the aux-layer sweep)


def build_drafter_for_target(
    target_path: str | Path,
    dataset: Any,
    draft_vocab_size: int,
    drafter_kw: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[Eagle3Drafter, VocabCoverage]:
    """A fresh drafter for the saved target at ``target_path``, and how well its draft vocabulary covers the data.

    Aux ids come from ``dataset.aux_layer_ids``; the draft vocabulary is the ``draft_vocab_size`` most
    frequent response tokens; embeddings (and lm_head rows) are the target's when widths match.
    ``drafter_kw`` goes to :func:`eagle3lab.drafter.build_drafter` (see :func:`eagle3lab.kwargs.drafter_kwargs`).
    """
    import json

    cfg = json.loads((Path(target_path) / "config.json").read_text())
    text_cfg = cfg.get("text_config") or cfg
    aux_ids = list(getattr(dataset, "aux_layer_ids", None) or [])
    if not aux_ids:
        raise ValueError("dataset has no aux_layer_ids: cannot size the drafter's fc")
    counts = token_counts_from_dataset(dataset, int(text_cfg["vocab_size"]))
    embed, head = target_embedding_weights(target_path)
    drafter = build_drafter(
        cfg, aux_ids, counts, draft_vocab_size, embed, head, seed=seed, **(drafter_kw or {})
    )
    return drafter, vocab_coverage(counts, drafter.t2d)


def train_drafter_for_target(
    target_path: str | Path,
    dataset: Any,
    draft_vocab_size: int,
    drafter_kw: dict[str, Any] | None = None,
    train_kw: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[Eagle3Drafter, TrainResult]:
    """:func:`build_drafter_for_target`, then :func:`train_drafter` with ``train_kw``
    (see :func:`eagle3lab.kwargs.train_kwargs`)."""
    drafter, _ = build_drafter_for_target(target_path, dataset, draft_vocab_size, drafter_kw, seed)
    result = train_drafter(drafter, dataset, seed=seed, **(train_kw or {}))
    return drafter, result
