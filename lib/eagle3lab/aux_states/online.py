"""Aux hidden states computed when training asks for them, with nothing stored: the "online" mode of SpecForge,
TorchSpec and speculators, beside 03's offline shards.

The seed's deployment wrote 828 GB of aux states for 10,000 samples (43 kB a token at Kimi-K2.5's widths) and read
them back for five epochs. Online, every training batch runs the target over its own sequences instead: no disk,
at the price of one target forward per sequence per epoch, where offline pays one per sequence in all plus the
writes and reads. Which wins depends on the target's forward against the disk, so
``benchmarks/tools/online_vs_offline.py`` measures both on the same run (disk, wall time, tau).

The states are rounded through the storage dtype the offline route would write (``data.hidden_dtype``), so the
two routes feed training the same numbers up to the target's batch-shape rounding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3lab import provenance
from eagle3lab.aux_states.hooks import check_aux_layer_ids
from eagle3lab.aux_states.shards import AuxSource, sample_tokens, storage_dtype
from eagle3lab.synthetic import read_samples


class OnlineAuxStates(torch.utils.data.Dataset):
    """The training items of ``samples_path`` (dicts of input_ids [T], loss_mask [T], aux [T, n*H]), their aux
    states computed by ``source`` when asked. :func:`eagle3lab.train.train_drafter` fetches a whole batch with one
    :meth:`get_batch`, one batched target forward, as SpecForge's online trainer does."""

    def __init__(self, source: AuxSource, samples_path: str | Path, aux_layer_ids: Sequence[int],
                 dtype: str = "float32") -> None:
        self.source = source
        self.aux_layer_ids: list[int] = check_aux_layer_ids(aux_layer_ids, source.num_layers)
        self.hidden_size = int(source.hidden_size)
        self.samples = read_samples(samples_path)
        if not self.samples:
            raise ValueError(f"no samples in {samples_path}")
        self.dtype = dtype
        self._round = storage_dtype(dtype)
        self._fingerprint = provenance.sha256_json({
            "aux_layer_ids": self.aux_layer_ids, "hidden_size": self.hidden_size, "dtype": dtype,
            "samples_sha256": provenance.sha256_file(samples_path), "target_weights": source.fingerprint(),
            "ids": [s["id"] for s in self.samples], "storage": "online"})
        # what the target's forwards cost training: the online route's price
        self.forward_seconds = 0.0
        self.forward_tokens = 0

    @property
    def fingerprint(self) -> str:
        """Samples, target, ids and dtype, as a :class:`HiddenStateDataset`'s: a drafter checkpoint resumes only on
        the same data (an offline dataset of the same samples has another fingerprint: the route is part of it)."""
        return self._fingerprint

    def __len__(self) -> int:
        return len(self.samples)

    def _tokens(self, idx: int) -> dict[str, torch.Tensor]:
        ids, mask = sample_tokens(self.samples[idx])
        return {"input_ids": ids, "loss_mask": mask}

    def get(self, idx: int, keys: Sequence[str] = ("input_ids", "loss_mask", "aux")) -> dict[str, torch.Tensor]:
        """Item ``idx``; without ``"aux"`` in ``keys`` no forward runs (token statistics for the draft vocabulary)."""
        if not 0 <= idx < len(self.samples):
            raise IndexError(f"index {idx} out of range for {len(self.samples)} sequences")
        if "aux" in keys:
            return {k: v for k, v in self.get_batch([idx])[0].items() if k in keys}
        return {k: v for k, v in self._tokens(idx).items() if k in keys}

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.get(idx)

    def get_batch(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The items at ``indices``, their aux states from one batched forward of the target."""
        items = [self._tokens(i) for i in indices]
        seqs = [it["input_ids"].tolist() for it in items]
        t0 = time.perf_counter()
        aux = self.source.aux_batch(seqs, self.aux_layer_ids)
        # the offline route stores this dtype and reads it back as float32: round the same way
        aux = aux.to(self._round).float().cpu()  # the copy to the host waits for the GPU: the timing is whole
        self.forward_seconds += time.perf_counter() - t0
        self.forward_tokens += sum(map(len, seqs))
        for r, it in enumerate(items):
            it["aux"] = aux[r, : len(seqs[r])]
        return items

