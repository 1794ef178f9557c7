"""The engine a profile asks for (``engine.kind``, ``engine.mode``), with every engine parameter honoured and the
patch's environment attached: the one mapping from a profile to an engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lab.engines.base import Engine
from eagle3lab.engines.reference import ReferenceEngine
from eagle3lab.engines.vllm_offline import VllmEngine
from eagle3lab.engines.vllm_served import VllmServedEngine
from eagle3lab.plugin import plugin_env


def make_engine(kind: str, target_path: str | Path, device: str = "auto", dtype: str = "auto", **kw: Any) -> Engine:
    """The engine named by ``kind`` (``params.engine.kind``); vLLM options go through ``kw``."""
    if kind == "reference":
        ref_kw = {k: kw[k] for k in ("trust_remote_code", "model", "tokenizer") if k in kw}
        return ReferenceEngine(target_path, device=device, dtype=dtype, **ref_kw)
    if kind == "vllm":
        mode = kw.pop("mode", "offline")
        if mode == "served":
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
