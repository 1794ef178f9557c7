"""Loading a saved target (the embedded one or a real checkpoint) with transformers, and the device and dtype
choices that go with it. Every engine that runs the target in this process uses it; the embedded target's own
construction is :mod:`eagle3lab.target`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3lab.errors import check_safetensors


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU (bf16 matmuls are slow there), bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r}: expected auto, float32, bfloat16 or float16")
    return table[dtype]


def load_target(
    path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto", trust_remote_code: bool = False
) -> tuple[nn.Module, Any]:
    """Load a saved target (embedded or a real checkpoint) and its tokenizer, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"target folder does not exist: {path} (run 00_target first?)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target folder {path} has no config.json: not a saved model")
    # transformers' own error for a damaged weights file names no file: each is checked first (headers only)
    for f in sorted(path.glob("*.safetensors")):
        check_safetensors(f, "target weights file", "copy or save the target again (rerun 00_target for the embedded one)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code)
    model = model.to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer
