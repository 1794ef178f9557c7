"""Engines that generate text from token ids: the reference engine (transformers) now, vLLM later.

Everything downstream (synthetic data, acceptance) talks to the :class:`Engine` protocol, so that the
same notebook runs on a laptop with :class:`ReferenceEngine` and on GPUs with a vLLM engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class SpeculativeResult:
    """Outputs of speculative decoding and the summed acceptance counters (``SpecDecodeStats``)."""

    outputs: list[list[int]]
    stats: Any
    # One SpecDecodeStats per prompt where the engine can attribute counters to a prompt (the reference
    # decoder always; vLLM when prompts are run one at a time), else None.
    per_prompt: list[Any] | None = None


@runtime_checkable
class Engine(Protocol):
    """What the workbook needs from an inference engine."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """New tokens for each prompt (no prompt), ending at EOS (included) when the tokenizer has one."""
        ...

    def speculative_generate(
        self,
        prompt_ids: list[list[int]],
        drafter_path: str | Path,
        num_speculative_tokens: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> SpeculativeResult:
        """Speculative decoding with an EAGLE-3 drafter. Greedy (temperature 0) outputs equal greedy
        ``generate``; above 0, drafts are verified by rejection sampling."""
        ...


def _check_prompts(prompt_ids: list[list[int]]) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids: empty prompt set")
    for i, p in enumerate(prompt_ids):
        if not p:
            raise ValueError(f"prompt_ids[{i}] is empty")


def cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """Tokens up to and including the first EOS (all of them without an EOS id)."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


class ReferenceEngine:
    """transformers on CPU or GPU: slow but exact, and runs anywhere."""

    def __init__(
        self,
        target_path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        from eagle3lab.target import load_target

        self.target_path = Path(target_path)
        if model is None or tokenizer is None:
            model, tokenizer = load_target(target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_token_id: int | None = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.eos_token_id if self.eos_token_id is not None else 0)

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """Generate for a batch of prompts (left-padded); greedy when ``temperature`` is 0."""
        _check_prompts(prompt_ids)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        kwargs: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            kwargs = {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}
        torch.manual_seed(seed)  # sampling draws from the global generator
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                **kwargs,
            )
        new = out[:, width:].tolist()
        return [cut_at_eos(row, self.eos_token_id)[:max_new_tokens] for row in new]

    def speculative_generate(
        self,
        prompt_ids: list[list[int]],
        drafter_path: str | Path,
        num_speculative_tokens: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> SpeculativeResult:
        """Run the reference chain decoder prompt by prompt and sum the acceptance counters."""
        if temperature != 0.0:
            raise NotImplementedError("the reference decoder verifies greedily only (temperature 0)")
        from eagle3lab.acceptance import SpecDecodeStats
        from eagle3lab.drafter import load_drafter
        from eagle3lab.speculate import speculative_generate

        _check_prompts(prompt_ids)
        if not Path(drafter_path).is_dir():
            raise FileNotFoundError(f"drafter folder does not exist: {drafter_path}")
        drafter = load_drafter(drafter_path, self.device)
        outputs: list[list[int]] = []
        total = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        per_prompt = []
        for p in prompt_ids:
            toks, stats = speculative_generate(
                self.model, drafter, list(p), num_speculative_tokens, max_new_tokens, self.eos_token_id
            )
            outputs.append(toks)
            per_prompt.append(stats)
            total = total + stats
        return SpeculativeResult(outputs=outputs, stats=total, per_prompt=per_prompt)


def make_engine(kind: str, target_path: str | Path, device: str = "auto", dtype: str = "auto", **kw: Any) -> Engine:
    """The engine named by ``kind`` (``params.engine.kind``)."""
    if kind == "reference":
        return ReferenceEngine(target_path, device=device, dtype=dtype, **kw)
    if kind == "vllm":
        raise ValueError(
            "engine.kind 'vllm': the vLLM engine is not available in this version of eagle3lab; "
            "use engine.kind 'reference'"
        )
    raise ValueError(f"engine.kind {kind!r}: expected 'reference' or 'vllm'")
