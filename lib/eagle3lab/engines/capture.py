"""Aux hidden states captured inside the vLLM engine that serves the target.

A target too large for one device (Kimi-K2.5: 1T parameters over 8 GPUs) cannot be loaded by transformers for
03's extraction; the engine that serves it already computes the states the drafter reads. vLLM collects them
when an EAGLE-3 drafter is configured: the model (patched where vLLM lacks the interface) returns
``(hidden_states, [aux ...])`` with aux ``k`` = the residual stream at the input of decoder layer ``k``, our
convention. So the extraction engine runs with an untrained drafter that names our aux ids, and a wrapper on
the loaded model's forward (installed in every worker through ``LLM.apply_model``) keeps what each prefill
returns.

One request at a time, one new token each, prefix caching off and the whole sequence in one prefill: every
captured forward is one sequence's prefill, its first ``len(sequence)`` rows (vLLM pads a batch to a CUDA-graph
size at the end). Under tensor parallelism every rank holds the full, all-reduced states; rank 0 answers. The
functions the workers run are :mod:`eagle3lab.engines.workers`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3lab import provenance
from eagle3lab.diagnose.target_info import read_json_config, text_config_of
from eagle3lab.engines.factory import engine_from_params
from eagle3lab.engines.launch_probe import random_probe_drafter
from eagle3lab.engines.workers import drain_aux_capture, install_aux_capture, remove_aux_capture


class EngineAuxSource:
    """:class:`eagle3lab.aux_states.shards.AuxSource` over a vLLM engine (a
    :class:`eagle3lab.engines.vllm_offline.VllmEngine`).

    ``probe_drafter`` is an EAGLE-3 drafter folder whose config names the aux ids to extract (an untrained one
    from :func:`eagle3lab.engines.launch_probe.random_probe_drafter` does: only its config matters here). The
    engine must run with prefix caching off, or a repeated prefix would not be computed again and its states would
    be missing.
    """

    def __init__(self, engine: Any, probe_drafter: str | Path, num_speculative_tokens: int = 1) -> None:
        opts = engine.options
        if opts.get("enable_prefix_caching", True):
            raise ValueError("in-engine extraction needs enable_prefix_caching=False in the engine's options")
        self.engine = engine
        self.probe_drafter = Path(probe_drafter)
        text = text_config_of(read_json_config(engine.target_path)[0])  # Kimi-K2.5 wraps its DeepSeek-V3 text model
        self.hidden_size = int(text["hidden_size"])
        self.num_layers = int(text["num_hidden_layers"])
        self.device = torch.device("cpu")  # the states arrive on the CPU
        drafter_cfg = json.loads((self.probe_drafter / "config.json").read_text())
        self.aux_layer_ids = sorted(drafter_cfg["eagle_aux_hidden_state_layer_ids"])
        self.max_len = int(opts.get("max_model_len") or 0)
        # the speculative config the capture runs under: with the k of a later speculative_generate on the same
        # drafter, both share one engine start (patch --prove)
        self.num_speculative_tokens = num_speculative_tokens
        self._llm: Any = None

    def fingerprint(self) -> str:
        """The target's checkpoint fingerprint (the engine holds no weights this process can hash)."""
        return provenance.checkpoint_fingerprint(self.engine.target_path)

    def _live(self) -> Any:
        llm = self.engine.llm(self.engine.eagle3_config(self.probe_drafter, self.num_speculative_tokens))
        if llm is not self._llm:  # a (re)started engine: install the capture in its workers
            llm.apply_model(install_aux_capture)
            self._llm = llm
        return llm

    def aux_batch(self, seqs: list[list[int]], aux_layer_ids: list[int]) -> torch.Tensor:
        if sorted(aux_layer_ids) != self.aux_layer_ids:
            raise ValueError(f"aux ids {sorted(aux_layer_ids)}: this engine extracts {self.aux_layer_ids} "
                             f"(the probe drafter's config)")
        if self.max_len and max(map(len, seqs)) >= self.max_len:
            raise ValueError(f"a sequence of {max(map(len, seqs))} tokens does not fit max_model_len {self.max_len}")
        llm = self._live()
        sp = self.engine._sampling(1, 0.0, 1.0, 0)  # noqa: SLF001
        width = len(self.aux_layer_ids) * self.hidden_size
        out = torch.zeros(len(seqs), max(map(len, seqs)), width)
        for r, seq in enumerate(seqs):
            self.engine._run(llm, [seq], sp)  # noqa: SLF001
            answers = [c for c in llm.apply_model(drain_aux_capture) if c]
            if not answers:
                raise RuntimeError("no worker captured aux states: the engine did not return them (is the EAGLE-3 "
                                   "interface missing, i.e. the patch not applied?)")
            caps = answers[0]
            # the prefill comes first; a drafter step of vLLM may follow with its own forward of the target's
            # head only, never of the target's layers
            pre = caps[0]
            if pre.shape[0] < len(seq) or pre.shape[1] != width:
                raise RuntimeError(f"captured {tuple(pre.shape)} for a sequence of {len(seq)} tokens x {width}: "
                                   "not one whole prefill (chunked prefill or prefix caching on?)")
            out[r, : len(seq)] = pre[: len(seq)].float()
        return out

    def close(self) -> None:
        """Remove the capture from the workers (the engine stays up)."""
        if self._llm is not None:
            self._llm.apply_model(remove_aux_capture)
            self._llm = None


def aux_source_from_params(
    params: Any, target_path: str | Path, aux_layer_ids: list[int], work_dir: str | Path,
    log_dir: str | Path | None = None,
) -> EngineAuxSource:
    """The profile's vLLM engine set up for extraction: offline (``apply_model``), prefix caching off, a whole
    sequence in one prefill, and an untrained probe drafter in ``work_dir`` that names ``aux_layer_ids``."""
    max_len = int(params.engine.max_model_len)
    engine = engine_from_params(params, target_path, log_dir=log_dir, offline=True,
                                extra={"enable_prefix_caching": False, "max_num_batched_tokens": max(max_len, 2048)})
    probe = random_probe_drafter(target_path, aux_layer_ids, work_dir)
    return EngineAuxSource(engine, probe)
