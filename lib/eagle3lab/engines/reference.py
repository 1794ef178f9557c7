"""The reference engine: transformers on CPU or GPU, slow but exact, and runs anywhere.

Its speculative decoding is :mod:`eagle3lab.speculate`'s chain decoder, the yardstick vLLM's counters are read against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3lab.acceptance import SpecDecodeStats
from eagle3lab.drafter import load_drafter
from eagle3lab.engines.base import SpeculativeResult, check_generate_args, check_prompts, cut_at_eos
from eagle3lab.speculate import mla_expand_memo, speculative_decode
from eagle3lab.target_loading import load_target


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
        check_generate_args(prompt_ids, max_new_tokens)
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
        # transformers re-expands the whole MLA cache at every step (quadratic in the context with kv_lora 512)
        with torch.no_grad(), mla_expand_memo(self.model):
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
        """Run the reference chain decoder prompt by prompt and sum the acceptance counters.

        Greedy verification at temperature 0 (outputs equal greedy decoding); rejection sampling above it,
        with drafts proposed greedily as vLLM's EAGLE proposer does. Prompt i samples from a generator
        seeded with ``seed + i``, so a prompt's result does not depend on the others.
        """
        check_prompts(prompt_ids)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not Path(drafter_path).is_dir():
            raise FileNotFoundError(f"drafter folder does not exist: {drafter_path}")
        drafter = load_drafter(drafter_path, self.device)
        total = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        traces = []
        for i, p in enumerate(prompt_ids):
            gen = torch.Generator().manual_seed(int(seed) + i) if temperature > 0 else None
            tr = speculative_decode(self.model, drafter, list(p), num_speculative_tokens, max_new_tokens,
                                    self.eos_token_id, temperature=temperature, generator=gen)
            traces.append(tr)
            total = total + tr.stats
        return SpeculativeResult(outputs=[t.output for t in traces], stats=total,
                                 per_prompt=[t.stats for t in traces], traces=traces)
