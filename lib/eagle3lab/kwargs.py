"""Profile -> keyword arguments: the one place that maps params fields to library parameters.

Library functions take explicit arguments (so tests reach them without a profile); notebooks and the
pipeline get those arguments from here instead of spelling the mapping out by hand in each place.
tests/test_kwargs.py checks every key against the called function's signature, so renaming a parameter
on either side fails CI instead of a notebook. The engine has its own home:
:func:`eagle3lab.engines.factory.engine_from_params`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lab.params import Params


def drafter_kwargs(params: Params) -> dict[str, Any]:
    """Drafter shape for :func:`eagle3lab.drafter.build_drafter` (and ``drafter_kw`` of
    :func:`eagle3lab.train.train_drafter_for_target`); None means "size it from the target"."""
    d = params.drafter
    return {
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
    }


def train_kwargs(
    params: Params,
    device: Any = "cpu",
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """TTT training settings for :func:`eagle3lab.train.train_drafter` (``train_kw`` of
    ``train_drafter_for_target``). The seed is passed on its own: it also seeds the drafter's init."""
    t = params.train
    kw: dict[str, Any] = {
        "ttt_steps": t.ttt_steps,
        "ttt_decay": t.ttt_decay,
        "epochs": t.epochs,
        "max_steps": t.max_steps,
        "batch_size": t.batch_size,
        "lr": t.learning_rate,
        "warmup": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "max_seq_len": t.max_seq_len,
        "checkpoint_every": t.checkpoint_every,
        "device": device,
        "progress": progress,
    }
    if checkpoint_dir is not None:
        kw["checkpoint_dir"] = checkpoint_dir
    return kw


def extraction_kwargs(params: Params, progress: bool = True) -> dict[str, Any]:
    """Storage settings for :func:`eagle3lab.aux_states.shards.extract_hidden_states`."""
    d = params.data
    return {
        "shard_sequences": d.shard_sequences,
        "dtype": d.hidden_dtype,
        "batch_size": d.batch_size,
        "progress": progress,
    }
