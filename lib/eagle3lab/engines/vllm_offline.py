"""vLLM's offline ``LLM`` behind the :class:`eagle3lab.engines.base.Engine` protocol.

vLLM is imported inside the methods that start or drive an engine, on purpose: importing it costs ~20 s of CPU on a
small host, and the modules that only name this class (the factory, 02's launch probe, their tests) must not pay it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eagle3lab.acceptance import stats_from_vllm_metrics
from eagle3lab.cost_model import (
    drain_forward_timer,
    forward_summary,
    install_forward_timer,
    remove_forward_timer,
)
from eagle3lab.engines.base import (
    Batch1Timing,
    DecodeTiming,
    SpeculativeResult,
    check_generate_args,
    check_prompts,
    cut_at_eos,
    speculative_config,
    workload_key,
)
from eagle3lab.engines.workers import WorkerReport, describe_loaded_model


@contextlib.contextmanager
def _stdio_to(log_file: Path | None) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``log_file`` while vLLM starts its engine core and workers.

    Those processes inherit the descriptors at start and keep them for life, so their log lines (and those of
    the libraries they load, e.g. FlashInfer's autotuner, torch's c10d warnings) go to the run's log instead
    of the notebook page; this process gets its own descriptors back afterwards.
    """
    if log_file is None:
        yield
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def metric_dicts(snapshot: list[Any]) -> list[dict[str, Any]]:
    """``LLM.get_metrics()`` as plain dicts (name, labels, value(s)): what fixtures and logs store."""
    out = []
    for m in snapshot:
        d: dict[str, Any] = {"type": type(m).__name__, "name": m.name, "labels": dict(m.labels)}
        for attr in ("value", "values", "count", "sum"):
            if hasattr(m, attr):
                v = getattr(m, attr)
                d[attr] = list(v) if isinstance(v, (list, tuple)) else v
        out.append(d)
    return out


class VllmEngine:
    """vLLM's offline ``LLM`` behind the :class:`Engine` protocol.

    One engine is alive at a time: the first call builds it without speculation, and a speculative call
    with another drafter or k replaces it (vLLM fixes the speculative config at start). The engine core
    and every tensor-parallel worker run in processes of their own, so the EAGLE-3 patch reaches them
    only through our ``vllm.general_plugins`` entry point, driven by ``patch_env`` (``EAGLE3LAB_PATCH``),
    which is put into this process's environment before each start so that they inherit it.
    """

    def __init__(
        self,
        target_path: str | Path,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int = 2048,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        seed: int = 0,
        attention_backend: str | None = None,
        draft_attention_backend: str | None = None,
        patch_env: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.target_path = Path(target_path)
        if not (self.target_path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in the target folder {self.target_path}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.target_path), trust_remote_code=trust_remote_code)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.device = "cuda"
        self.options: dict[str, Any] = dict(
            model=str(self.target_path),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code,  # never implied: only what the params state
            seed=seed,
            disable_log_stats=False,  # the spec-decode counters live in the stats
            **({"attention_backend": attention_backend} if attention_backend else {}),
            **(extra or {}),
        )
        self.draft_attention_backend = draft_attention_backend
        self.patch_env = dict(patch_env or {})
        self.log_file = Path(log_dir) / "vllm-engine.log" if log_dir is not None else None
        self._llm: Any = None
        self._spec: dict[str, Any] | None = None
        self._warm = False  # whether the live engine has run the warm-up of _warm_up
        self.start_seconds: list[float] = []

    def eagle3_config(self, drafter_path: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """The speculative config of an EAGLE-3 run of this engine (its drafter attention backend included)."""
        return speculative_config(drafter_path, num_speculative_tokens, self.draft_attention_backend)

    # -- lifecycle
    def llm(self, speculative_config: dict[str, Any] | None = None) -> Any:
        """The live ``vllm.LLM`` for this speculative config (None: no speculation), started if needed."""
        if self._llm is not None and self._spec == speculative_config:
            return self._llm
        self.close()
        from vllm import LLM  # lazy: see the module's docstring

        os.environ.update(self.patch_env)
        # Our worker probes (describe_loaded_model) travel to the workers as pickled functions.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        # vLLM forks its engine core by default on a GPU host. A forked child inherits the notebook kernel's
        # sys.stdout/sys.stderr objects, which ipykernel forwards to the page whatever fd 1 and 2 point at (seen
        # on the H200: FlashInfer's autotuner lines on the 03/05 pages). A spawned one writes to the log file.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        kw = dict(self.options)
        if speculative_config is not None:
            kw["speculative_config"] = dict(speculative_config)
        t0 = time.perf_counter()
        with _stdio_to(self.log_file):
            self._llm = LLM(**kw)
        self.start_seconds.append(time.perf_counter() - t0)
        self._spec = speculative_config
        self._warm = False
        return self._llm

    # A fresh engine compiles Triton kernels and autotunes on its first requests (seen on the H200: a first
    # EAGLE-3 batch took 12x its steady time), so wall times are taken after one untimed pass over the first
    # prompts of the workload, once per engine start.
    WARM_UP_PROMPTS = 8

    def _warm_up(self, llm: Any, prompt_ids: list[list[int]], sampling: Any) -> None:
        if not self._warm:
            self._run(llm, prompt_ids[: self.WARM_UP_PROMPTS], sampling)
            self._warm = True

    def close(self) -> None:
        """Shut the engine core and its workers down and free their GPU memory."""
        if self._llm is None:
            return
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._llm = None
        self._spec = None
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- generation
    @staticmethod
    def _sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int, ignore_eos: bool = False) -> Any:
        from vllm import SamplingParams  # lazy: see the module's docstring

        return SamplingParams(
            max_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
            seed=int(seed) if temperature > 0 else None, ignore_eos=ignore_eos,
        )  # fmt: skip

    def _run(self, llm: Any, prompt_ids: list[list[int]], sp: Any) -> list[list[int]]:
        from vllm.inputs import TokensPrompt  # lazy: see the module's docstring

        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], sp, use_tqdm=False)
        return [cut_at_eos(list(o.outputs[0].token_ids), self.eos_token_id) for o in outs]

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """New tokens per prompt from the target alone (no speculation), ending at EOS (included)."""
        check_generate_args(prompt_ids, max_new_tokens)
        llm = self.llm(None)
        sp = self._sampling(max_new_tokens, temperature, top_p, seed)
        self._warm_up(llm, prompt_ids, sp)
        t0 = time.perf_counter()
        out = self._run(llm, prompt_ids, sp)
        # kept so that a speculative run of the same workload can report a measured speedup
        self._last_plain = (workload_key(prompt_ids, max_new_tokens, temperature), time.perf_counter() - t0)
        return out

    def time_batch1(self, prompt_ids: list[list[int]], max_new_tokens: int) -> Batch1Timing:
        """Greedy decoding without speculation, one prompt at a time, each timed (the batch-1 baseline)."""
        check_prompts(prompt_ids)
        llm = self.llm(None)
        sp = self._sampling(max_new_tokens, 0.0, 1.0, 0)
        self._warm_up(llm, prompt_ids, sp)
        timing = Batch1Timing()
        for p in prompt_ids:
            timing.timed(lambda p=p: self._run(llm, [p], sp)[0])
        return timing

    def speculative_generate(
        self,
        prompt_ids: list[list[int]],
        drafter_path: str | Path,
        num_speculative_tokens: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        per_prompt: bool = True,
    ) -> SpeculativeResult:
        """EAGLE-3 in vLLM; counters from ``get_metrics()`` differences.

        The whole batch runs once (outputs and totals); with ``per_prompt`` every prompt then runs alone
        so that its counters can be told apart (vLLM's counters are engine-wide, not per request).
        """
        check_prompts(prompt_ids)
        if not (Path(drafter_path) / "config.json").is_file():
            raise FileNotFoundError(f"no drafter config.json in {drafter_path}")
        llm = self.llm(self.eagle3_config(drafter_path, num_speculative_tokens))
        sp = self._sampling(max_new_tokens, temperature, 1.0, seed)
        self._warm_up(llm, prompt_ids, sp)
        before = llm.get_metrics()
        t0 = time.perf_counter()
        outputs = self._run(llm, prompt_ids, sp)
        decode_s = time.perf_counter() - t0
        stats = stats_from_vllm_metrics(before, llm.get_metrics())
        plain = getattr(self, "_last_plain", None)
        baseline_s = plain[1] if plain and plain[0] == workload_key(prompt_ids, max_new_tokens, temperature) else None
        each, batch1 = None, None
        if per_prompt:
            each, batch1 = [], Batch1Timing()
            for p in prompt_ids:
                b = llm.get_metrics()
                batch1.timed(lambda p=p: self._run(llm, [p], sp)[0])
                each.append(stats_from_vllm_metrics(b, llm.get_metrics()))
        return SpeculativeResult(outputs=outputs, stats=stats, per_prompt=each, decode_seconds=decode_s,
                                 baseline_seconds=baseline_s, batch1=batch1)

    def _run_tokens(self, llm: Any, prompt_ids: list[list[int]], sp: Any) -> list[list[int]]:
        # Every token each request made, EOS included and not cut: with ignore_eos, what the engine decoded.
        from vllm.inputs import TokensPrompt  # lazy: see the module's docstring

        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def time_decode(
        self,
        prompt_ids: list[list[int]],
        new_tokens: int,
        drafter_path: str | Path | None = None,
        num_speculative_tokens: int = 0,
        time_forwards: bool = True,
    ) -> DecodeTiming:
        """Decode ``prompt_ids`` as one batch, ``new_tokens`` tokens each with EOS ignored, greedy, and time it.

        Without ``drafter_path`` on the plain engine, with it on the EAGLE-3 engine of that drafter and k (started
        if needed). One untimed run of the same batch comes first (a batch's first shapes compile and autotune on a
        GPU); the timed run follows, with the spec-decode counters read around it. With ``time_forwards`` a third
        run times the target's forward inside the worker (synchronised, so not in the timed run): the plain step's
        forward over one token per request, or the verify pass's over k + 1 (see
        :func:`eagle3lab.cost_model.forward_summary` for when that cannot be measured).
        """
        check_prompts(prompt_ids)
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
        spec = None
        if drafter_path is not None:
            if num_speculative_tokens < 1:
                raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
            if not (Path(drafter_path) / "config.json").is_file():
                raise FileNotFoundError(f"no drafter config.json in {drafter_path}")
            spec = self.eagle3_config(drafter_path, num_speculative_tokens)
        k = num_speculative_tokens if spec is not None else 0
        llm = self.llm(spec)
        sp = self._sampling(new_tokens, 0.0, 1.0, 0, ignore_eos=True)
        self._run_tokens(llm, prompt_ids, sp)  # warm-up of this batch
        before = llm.get_metrics() if spec is not None else None
        t0 = time.perf_counter()
        outs = self._run_tokens(llm, prompt_ids, sp)
        seconds = time.perf_counter() - t0
        stats = stats_from_vllm_metrics(before, llm.get_metrics()) if spec is not None else None
        timing = DecodeTiming(batch=len(prompt_ids), new_tokens=new_tokens, seconds=seconds,
                              output_tokens=sum(map(len, outs)), num_speculative_tokens=k, stats=stats,
                              forward_note="not timed")
        if time_forwards:
            try:
                infos = llm.apply_model(install_forward_timer)
            except Exception as exc:  # noqa: BLE001 - a worker that cannot be instrumented leaves the figure unmeasured
                timing.forward_note = f"not measured: the forward timer could not be installed ({type(exc).__name__}: {exc})"
                return timing
            try:
                self._run_tokens(llm, prompt_ids, sp)
                answers = [a for a in llm.apply_model(drain_forward_timer) if a]
            finally:
                llm.apply_model(remove_forward_timer)
            timing.forward_seconds, timing.forward_note = forward_summary(answers[0] if answers else [],
                                                                          len(prompt_ids) * (1 + k))
            timing.device, timing.dtype = infos[0]["device"], infos[0]["dtype"]
        return timing

    # -- inspection
    def worker_reports(self) -> list[WorkerReport]:
        """Ask every worker of the live engine what it loaded (class, EAGLE-3 verdict, forward)."""
        llm = self._llm if self._llm is not None else self.llm(None)
        return [WorkerReport(**d) for d in llm.apply_model(describe_loaded_model)]

    def metrics_snapshot(self) -> list[dict[str, Any]]:
        """The live engine's metrics as plain dicts."""
        return metric_dicts(self._llm.get_metrics()) if self._llm is not None else []


