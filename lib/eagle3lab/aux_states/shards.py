"""Aux hidden states extracted to disk: safetensors shards and a manifest rewritten atomically after each one, the
sources they are read from (:class:`AuxSource`), and the dataset that reads them back.

An extraction folder records what it was made from (the samples file's hash, the target's weights'
fingerprint, the ids, dtype and width): a resumed extraction whose inputs changed starts afresh and says
which input changed, instead of appending new shards to stale ones.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eagle3lab import provenance
from eagle3lab.aux_states.hooks import check_aux_layer_ids, decoder_parts, target_forward_with_aux
from eagle3lab.errors import check_safetensors
from eagle3lab.progress import progress as progress_bar
from eagle3lab.synthetic import read_samples

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype aux states are stored in (``data.hidden_dtype``)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class ExtractionStats:
    """Totals of an extraction (over all runs of a resumed one)."""

    sequences: int
    tokens: int
    seconds: float
    tokens_per_s: float
    bytes: int
    bytes_per_token: float
    complete: bool
    shards: int
    # Why an existing extraction was discarded and redone (which input changed), or None.
    rebuilt: str | None = None


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def read_manifest(hidden_dir: str | Path) -> dict[str, Any]:
    """The manifest of an extraction folder (FileNotFoundError if there is none)."""
    path = Path(hidden_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {hidden_dir}: hidden states were not extracted there")
    return json.loads(path.read_text())


def _stats(manifest: dict[str, Any], rebuilt: str | None = None) -> ExtractionStats:
    s = manifest["stats"]
    tokens, secs, size = s["tokens"], s["seconds"], s["bytes"]
    return ExtractionStats(
        sequences=s["sequences"],
        tokens=tokens,
        seconds=secs,
        tokens_per_s=tokens / secs if secs > 0 else float("nan"),
        bytes=size,
        bytes_per_token=size / tokens if tokens else float("nan"),
        complete=bool(manifest["complete"]),
        shards=len(manifest["shards"]),
        rebuilt=rebuilt,
    )


# At most this many computed shards wait for (or are in) the writer thread; queueing another blocks until
# one is on disk. With the shard being computed besides, at most three shards are in host memory: enough
# for a slow write to overlap the next shard's forwards, and a bound however far the disk falls behind.
SHARDS_IN_FLIGHT = 2


@dataclass
class _HostBatch:
    """One batch's aux states on their way to the host."""

    aux: torch.Tensor  # [B, T, n_aux * H] on the CPU; pinned when it comes from CUDA
    ready: torch.cuda.Event | None  # recorded after the copy into ``aux``; None: the copy was synchronous

    def wait(self) -> torch.Tensor:
        """The CPU tensor, once the copy into it has finished."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.aux


def _to_host(aux: torch.Tensor, out_dtype: torch.dtype, copy_stream: torch.cuda.Stream | None) -> _HostBatch:
    """Copy ``aux`` to the CPU as ``out_dtype``: on CUDA started on ``copy_stream`` and not waited for."""
    if copy_stream is None:
        return _HostBatch(aux.to("cpu", out_dtype), None)
    # Cast on the device: a float32 target stored in bfloat16 moves half the bytes. Both devices cast
    # with round-to-nearest-even, so the stored bytes are those of a cast on the CPU.
    aux = aux.to(out_dtype)
    # Only a copy into pinned memory is asynchronous; from pageable memory the host waits for it.
    host = torch.empty(aux.shape, dtype=out_dtype, pin_memory=True)
    # On a side stream, so that the next batch's forward does not queue behind the copy.
    copy_stream.wait_stream(torch.cuda.current_stream(aux.device))
    with torch.cuda.stream(copy_stream):
        host.copy_(aux, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy_stream)
    # aux is freed on the compute stream: keep its memory from the next forward until the copy has read it.
    aux.record_stream(copy_stream)
    return _HostBatch(host, ready)


def _padded_batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``seqs``, padded on the right to the longest."""
    # Right padding: causal attention keeps real tokens blind to the pad, so states are exact.
    x = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, s in enumerate(seqs):
        x[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    return x, mask


def _sequence(rec: dict[str, Any]) -> list[int]:
    return list(rec["prompt_ids"]) + list(rec["output_ids"])


def sample_tokens(rec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's training tokens: input_ids (prompt + response, long) and its loss mask (bool, True on the
    response: the drafter learns what the target answered, not the prompt). The shards store both, the online
    route (:mod:`eagle3lab.aux_states.online`) makes them when asked."""
    seq = _sequence(rec)
    mask = torch.zeros(len(seq), dtype=torch.bool)
    mask[len(rec["prompt_ids"]) :] = True
    return torch.tensor(seq, dtype=torch.long), mask


@dataclass
class _ComputedShard:
    """A shard whose forwards have been issued; its aux states may still be on their way to the host."""

    index: int
    samples: list[dict[str, Any]]
    batches: list[_HostBatch]  # consecutive samples, in order
    tokens: int

    @property
    def ids(self) -> list[Any]:
        return [s["id"] for s in self.samples]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shard's entries ``{i}.input_ids``, ``{i}.loss_mask``, ``{i}.aux``, once the copies are done."""
        tensors: dict[str, torch.Tensor] = {}
        i = 0
        for hb in self.batches:
            aux = hb.wait()
            for r in range(aux.shape[0]):
                ids, mask = sample_tokens(self.samples[i])
                tensors[f"{i}.input_ids"] = ids
                tensors[f"{i}.loss_mask"] = mask.to(torch.uint8)  # stored as bytes, read back as bool
                tensors[f"{i}.aux"] = aux[r, : len(ids)].contiguous()
                i += 1
        return tensors


@runtime_checkable
class AuxSource(Protocol):
    """Where aux states come from: a transformers model here (:class:`ModelAuxSource`), or the vLLM engine that
    serves the target (:class:`eagle3lab.engines.capture.EngineAuxSource`)."""

    hidden_size: int
    num_layers: int
    device: torch.device

    def fingerprint(self) -> str:
        """What identifies the target's weights in an extraction folder's provenance."""
        ...

    def aux_batch(self, seqs: list[list[int]], aux_layer_ids: list[int]) -> torch.Tensor:
        """Aux states of each sequence: [B, T, n_aux * H], right-padded to the longest, ascending ids."""
        ...


class ModelAuxSource:
    """Aux states from a transformers decoder through :func:`target_forward_with_aux` (batched, padded)."""

    def __init__(self, model: nn.Module, device: str | torch.device | None = None) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.hidden_size = int(model.config.hidden_size)
        self.num_layers = len(decoder_parts(model)[1])

    def fingerprint(self) -> str:
        return provenance.model_fingerprint(self.model)

    def aux_batch(self, seqs: list[list[int]], aux_layer_ids: list[int]) -> torch.Tensor:
        x, mask = _padded_batch(seqs)
        return target_forward_with_aux(self.model, x.to(self.device), aux_layer_ids, mask.to(self.device),
                                       logits=False).aux


def _compute_shard(
    source: AuxSource,
    index: int,
    samples: list[dict[str, Any]],
    aux_layer_ids: list[int],
    batch_size: int,
    out_dtype: torch.dtype,
    copy_stream: torch.cuda.Stream | None,
    bar: Any,
) -> _ComputedShard:
    """Run the target over one shard's samples, ``batch_size`` at a time, without waiting for the copies."""
    batches: list[_HostBatch] = []
    tokens = 0
    for b in range(0, len(samples), batch_size):
        seqs = [_sequence(rec) for rec in samples[b : b + batch_size]]
        aux = source.aux_batch(seqs, aux_layer_ids)
        batches.append(_to_host(aux, out_dtype, copy_stream if aux.is_cuda else None))
        del aux
        tokens += sum(len(s) for s in seqs)
        bar.update(len(seqs))
    return _ComputedShard(index, samples, batches, tokens)


class _ShardWriter:
    """Writes computed shards in order on one background thread and records each in the manifest.

    The manifest is the writer's while it runs; the caller reads it only after :meth:`finish` or
    :meth:`abort`. A shard enters the manifest only once its file is renamed into place, and after a failed
    write no later shard is written, so the manifest always lists a prefix of the shards, all on disk:
    a resumed run carries on after it.
    """

    def __init__(
        self, out: Path, manifest: dict[str, Any], n_shards: int, max_in_flight: int = SHARDS_IN_FLIGHT
    ) -> None:
        self._out = out
        self._manifest = manifest
        self._n_shards = n_shards
        self._max_in_flight = max_in_flight
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3lab-shard-writer")
        self._pending: deque[Future[None]] = deque()
        self._failed = False  # a write failed: writing later shards would leave a gap in the manifest
        self._stopping = False
        # Each shard's "seconds" is the wall time since the previous one was recorded: with compute and
        # writes overlapped, a shard's own time is not defined, but the sum is the run's wall time.
        self._clock = time.perf_counter()

    def submit(self, shard: _ComputedShard) -> None:
        """Queue ``shard``, first waiting while ``max_in_flight`` are queued; re-raises a failed write."""
        while self._pending and (self._pending[0].done() or len(self._pending) >= self._max_in_flight):
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._write, shard))

    def finish(self) -> None:
        """Wait until every queued shard is written; re-raises the first failed write."""
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Drop the queued shards, wait for the one being written, and end the thread."""
        self._stopping = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fut in self._pending:
            if not fut.cancelled() and fut.exception() is not None:
                log.warning("shard writer, stopped after an error: %r", fut.exception())
        self._pending.clear()

    def _write(self, shard: _ComputedShard) -> None:
        # Runs on the writer thread, one shard at a time in submission order.
        if self._failed or self._stopping:
            return  # an earlier write failed (the caller gets that error first), or the run is stopping
        try:
            self._write_shard(shard)
        except BaseException:
            self._failed = True
            raise

    def _write_shard(self, shard: _ComputedShard) -> None:
        name = f"shard-{shard.index:05d}.safetensors"
        tmp = self._out / (name + ".tmp")
        save_file(shard.tensors(), str(tmp), metadata={"ids": json.dumps(shard.ids)})
        os.replace(tmp, self._out / name)
        self._record(name, shard, (self._out / name).stat().st_size)

    def _record(self, name: str, shard: _ComputedShard, size: int) -> None:
        now = time.perf_counter()
        secs, self._clock = now - self._clock, now
        m = self._manifest
        m["shards"].append({"file": name, "ids": shard.ids, "tokens": shard.tokens, "bytes": size})
        st = m["stats"]
        st["sequences"] += len(shard.samples)
        st["tokens"] += shard.tokens
        st["seconds"] += secs
        st["bytes"] += size
        st["tokens_per_s"] = st["tokens"] / st["seconds"] if st["seconds"] > 0 else None
        st["bytes_per_token"] = st["bytes"] / st["tokens"]
        m["complete"] = len(m["shards"]) == self._n_shards
        _write_json_atomic(self._out / MANIFEST, m)


def extract_hidden_states(
    model: nn.Module | AuxSource,
    samples_path: str | Path,
    aux_layer_ids: Sequence[int],
    out_dir: str | Path,
    shard_sequences: int = 64,
    dtype: str = "float32",
    batch_size: int = 8,
    device: str | torch.device | None = None,
    target: str | Path | None = None,
    progress: bool = True,
    max_shards: int | None = None,
    on_stale: str = "rebuild",
) -> ExtractionStats:
    """Run the target over prompt+response of every sample and store aux states in safetensors shards.

    ``model`` is a transformers decoder, or any :class:`AuxSource` (e.g. the vLLM engine serving the target).

    Shard ``j`` holds samples ``j*shard_sequences`` .. ``(j+1)*shard_sequences - 1`` (in id order); key
    ``"{i}.input_ids"``, ``"{i}.loss_mask"`` (1 on response tokens) and ``"{i}.aux"`` for its i-th sequence
    (``manifest["shards"][j]["ids"][i]`` is the sample id). One background thread writes the shards while
    the target runs over the next ones (on CUDA the copies to the host are asynchronous too), so at most
    :data:`SHARDS_IN_FLIGHT` + 1 shards are in host memory. Each shard is written to a temp name and
    renamed, then the manifest is rewritten atomically, so a killed run resumes after its last complete
    shard with nothing lost or duplicated; a failed write is raised here, after the writer has stopped.
    ``max_shards`` stops after that many new shards (chunked runs, tests).

    Provenance: the manifest records the samples file's sha256, the model's weights fingerprint
    (:func:`eagle3lab.provenance.model_fingerprint`), the ids, dtype and width. An existing folder made
    from other inputs is discarded and redone (``on_stale="rebuild"``, logged with the inputs that
    changed, and reported in ``ExtractionStats.rebuilt``) or refused (``on_stale="refuse"``: ValueError
    naming them).
    """
    if on_stale not in ("rebuild", "refuse"):
        raise ValueError(f"on_stale {on_stale!r}: expected 'rebuild' or 'refuse'")
    out_dtype = storage_dtype(dtype)
    if shard_sequences < 1 or batch_size < 1:
        raise ValueError("shard_sequences and batch_size must be >= 1")
    source = model if isinstance(model, AuxSource) else ModelAuxSource(model, device)
    ids = check_aux_layer_ids(aux_layer_ids, source.num_layers)
    samples = read_samples(samples_path)
    if not samples:
        raise ValueError(f"no samples in {samples_path}")
    dev = source.device
    hidden_size = source.hidden_size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / MANIFEST
    made_from = {
        "aux_layer_ids": ids,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "samples_sha256": provenance.sha256_file(samples_path),
        "target_weights": source.fingerprint(),
    }
    fresh = {
        **made_from,
        "num_aux": len(ids),
        "target": str(target) if target is not None else None,
        "complete": False,
        "shards": [],
        "stats": {"sequences": 0, "tokens": 0, "seconds": 0.0, "bytes": 0},
    }
    manifest = json.loads(mpath.read_text()) if mpath.is_file() else fresh
    rebuilt = None
    stale = provenance.changed(manifest, made_from) if manifest is not fresh else []
    if stale:
        why = f"{mpath}: made from other inputs ({', '.join(stale)} changed)"
        if on_stale == "refuse":
            raise ValueError(f"{why}; use another folder, delete this one, or pass on_stale='rebuild'")
        log.warning("%s: discarding %d shards and extracting afresh", why, len(manifest.get("shards", [])))
        for rec in manifest.get("shards", []):
            (out / rec["file"]).unlink(missing_ok=True)
        manifest, rebuilt = fresh, why
    shards = [samples[i : i + shard_sequences] for i in range(0, len(samples), shard_sequences)]
    start = len(manifest["shards"])
    for j, rec in enumerate(manifest["shards"]):
        if j >= len(shards) or rec["ids"] != [s["id"] for s in shards[j]]:
            raise ValueError(f"{mpath}: shard {j} does not match the samples in {samples_path}; start afresh")
        # A finished shard is kept as it is: one damaged since (a failed copy, a full disk) is named here, in
        # 03, rather than by the dataset in 04.
        check_safetensors(out / rec["file"], "hidden-state shard", _SHARD_REMEDY.format(folder=out))
    bar = progress_bar(total=sum(len(s) for s in shards), initial=sum(len(s) for s in shards[:start]),
                       desc="extracting hidden states", disable=not progress)
    # The forwards of shard j+1 run while the writer thread stores shard j; on CUDA each batch's copy to
    # the host runs on a side stream, so the GPU goes on to the next forward at once.
    copy_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    stop = len(shards) if max_shards is None else max(start, min(len(shards), start + max_shards))
    writer = _ShardWriter(out, manifest, len(shards))
    try:
        for j in range(start, stop):
            shard = _compute_shard(source, j, shards[j], ids, batch_size, out_dtype, copy_stream, bar)
            writer.submit(shard)
        writer.finish()
    except BaseException:  # KeyboardInterrupt too: leave the manifest listing only shards on disk
        writer.abort()
        raise
    finally:
        bar.close()
    if (len(manifest["shards"]) == len(shards) and not manifest["complete"]) or not mpath.is_file():
        manifest["complete"] = len(manifest["shards"]) == len(shards)
        _write_json_atomic(mpath, manifest)
    return _stats(manifest, rebuilt)


_SHARD_REMEDY = "delete {folder} and rerun 03_engine to extract the hidden states again"


class HiddenStateDataset(torch.utils.data.Dataset):
    """Sequences of an extraction folder: dicts of input_ids [T], loss_mask (bool) [T], aux (float) [T, n*H]."""

    def __init__(self, hidden_dir: str | Path, allow_incomplete: bool = False) -> None:
        self.hidden_dir = Path(hidden_dir)
        self.manifest = read_manifest(hidden_dir)
        if not self.manifest["complete"] and not allow_incomplete:
            raise ValueError(
                f"{self.hidden_dir}: extraction is incomplete ({len(self.manifest['shards'])} shards written); "
                "finish it (re-run resumes) or pass allow_incomplete=True"
            )
        self.aux_layer_ids: list[int] = list(self.manifest["aux_layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self._index = [(s, i) for s, rec in enumerate(self.manifest["shards"]) for i in range(len(rec["ids"]))]
        self.sample_ids = [sid for rec in self.manifest["shards"] for sid in rec["ids"]]
        self._open: tuple[int, Any] | None = None

    @property
    def fingerprint(self) -> str:
        """What these states were made from (samples, target weights, ids, dtype) and which sequences:
        a drafter checkpoint records it, so training never resumes on other data."""
        keys = ("aux_layer_ids", "hidden_size", "dtype", "samples_sha256", "target_weights")
        return provenance.sha256_json({**{k: self.manifest.get(k) for k in keys}, "ids": self.sample_ids})

    def __len__(self) -> int:
        return len(self._index)

    def _handle(self, shard: int) -> Any:
        if self._open is None or self._open[0] != shard:
            path = self.hidden_dir / self.manifest["shards"][shard]["file"]
            if not path.is_file():
                raise FileNotFoundError(f"shard listed in the manifest is missing: {path}")
            check_safetensors(path, "hidden-state shard", _SHARD_REMEDY.format(folder=self.hidden_dir))
            self._open = (shard, safe_open(str(path), framework="pt"))
        return self._open[1]

    def get(self, idx: int, keys: Sequence[str] = ("input_ids", "loss_mask", "aux")) -> dict[str, torch.Tensor]:
        """Item ``idx`` with only some of its tensors (cheap token statistics)."""
        if not 0 <= idx < len(self._index):
            raise IndexError(f"index {idx} out of range for {len(self._index)} sequences")
        shard, i = self._index[idx]
        h = self._handle(shard)
        out: dict[str, torch.Tensor] = {}
        if "input_ids" in keys:
            out["input_ids"] = h.get_tensor(f"{i}.input_ids").long()
        if "loss_mask" in keys:
            out["loss_mask"] = h.get_tensor(f"{i}.loss_mask").bool()
        if "aux" in keys:
            out["aux"] = h.get_tensor(f"{i}.aux").float()
        return out

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.get(idx)


def iter_token_ids(hidden_dir: str | Path, allow_incomplete: bool = False):
    """Yield ``(input_ids LongTensor[T], loss_mask BoolTensor[T])`` per stored sequence, without the aux states."""
    ds = HiddenStateDataset(hidden_dir, allow_incomplete=allow_incomplete)
    for k in range(len(ds)):
        item = ds.get(k, ("input_ids", "loss_mask"))
        yield item["input_ids"], item["loss_mask"]
