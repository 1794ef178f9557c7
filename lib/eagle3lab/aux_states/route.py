"""03's choice of where the aux hidden states come from (``data.extractor``), and the check that goes with it.

``transformers``: the target in transformers (the reference engine's own model on the CPU profile; on a GPU
profile the vLLM engine is closed first to free its memory, and the target is loaded on the same device), with
our capture checked against a hand computation on one sample. ``engine``: inside the vLLM engine that serves the
target (a target transformers cannot hold, e.g. Kimi-K2.5 at TP 8); no hand computation is possible there, and
that route is checked against transformers in ``tests/test_engine_capture.py`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lab.aux_states.hooks import AUX_AGREEMENT_TOL, verify_aux_mapping
from eagle3lab.engines.capture import aux_source_from_params
from eagle3lab.engines.reference import ReferenceEngine


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
