"""Extraction with the shard writes on a background thread: same shards as a synchronous run, writer errors
raised in the caller, a manifest that lists only shards on disk, and writes that overlap the forwards."""

from __future__ import annotations

import json
import threading

import pytest
import safetensors.torch
import torch

from eagle3lab import target as T
from eagle3lab.aux_states import hooks as HK
from eagle3lab.aux_states import shards as H
from eagle3lab.synthetic import read_samples
from test_hidden_states import _samples, _Tok

IDS = [1, 4]
KW = {"shard_sequences": 3, "batch_size": 2, "progress": False}  # 7 samples: 3 shards, a short last batch


@pytest.fixture(scope="module")
def model():
    return T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0).eval()


def _reference_shard(model, recs, batch_size, dtype) -> bytes:
    """One shard as the synchronous extraction wrote it: a forward per batch, copied to the CPU at once."""
    tensors = {}
    for b in range(0, len(recs), batch_size):
        seqs = [r["prompt_ids"] + r["output_ids"] for r in recs[b : b + batch_size]]
        x = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, s in enumerate(seqs):
            x[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
        aux = HK.target_forward_with_aux(model, x, IDS, mask).aux.to("cpu", dtype)
        for r, (s, rec) in enumerate(zip(seqs, recs[b : b + batch_size], strict=True)):
            lm = torch.zeros(len(s), dtype=torch.uint8)
            lm[len(rec["prompt_ids"]) :] = 1
            tensors[f"{b + r}.input_ids"] = torch.tensor(s)
            tensors[f"{b + r}.loss_mask"] = lm
            tensors[f"{b + r}.aux"] = aux[r, : len(s)].contiguous()
    return safetensors.torch.save(tensors, metadata={"ids": json.dumps([r["id"] for r in recs])})


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard-*"))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shards_equal_a_synchronous_reference(model, tmp_path, dtype, one_thread):
    samples = _samples(tmp_path / "samples.jsonl")
    st = H.extract_hidden_states(model, samples, IDS, tmp_path / "h", dtype=dtype, **KW)
    recs = read_samples(samples)
    shards = [recs[i : i + 3] for i in range(0, len(recs), 3)]
    dt = H._DTYPES[dtype]
    want = {f"shard-{j:05d}.safetensors": _reference_shard(model, s, 2, dt) for j, s in enumerate(shards)}
    assert _files(tmp_path / "h") == want  # byte for byte, and no temp file left
    m = H.read_manifest(tmp_path / "h")
    assert m["complete"] and st.complete and st.shards == 3
    tokens = [sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in s) for s in shards]
    assert m["shards"] == [
        {"file": f, "ids": [r["id"] for r in s], "tokens": n, "bytes": len(want[f])}
        for f, s, n in zip(want, shards, tokens, strict=True)
    ]
    sizes = sum(map(len, want.values()))
    assert {k: m["stats"][k] for k in ("sequences", "tokens", "bytes")} == {
        "sequences": 7, "tokens": sum(tokens), "bytes": sizes
    }
    assert m["stats"]["seconds"] > 0 and m["aux_layer_ids"] == IDS and m["dtype"] == dtype


def test_writer_error_is_raised_and_the_run_resumes(model, tmp_path, monkeypatch, one_thread):
    samples = _samples(tmp_path / "samples.jsonl")
    H.extract_hidden_states(model, samples, IDS, tmp_path / "full", **KW)
    real, real_submit, calls = safetensors.torch.save_file, H._ShardWriter.submit, []
    third_queued = threading.Event()

    def submit(self, shard):
        real_submit(self, shard)
        if shard.index == 2:
            third_queued.set()

    def fail_on_second(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            # Fail only once shard 2 is queued behind this one: the writer must then not write it.
            assert third_queued.wait(timeout=30), "shard 2 was not queued while shard 1 was being written"
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(H._ShardWriter, "submit", submit)
    monkeypatch.setattr(H, "save_file", fail_on_second)  # shards imports it at module level
    with pytest.raises(OSError, match="disk full"):
        H.extract_hidden_states(model, samples, IDS, tmp_path / "h", **KW)
    assert len(calls) == 2  # nothing written after the failed shard: no gap in what the manifest could list
    m = H.read_manifest(tmp_path / "h")
    assert [r["file"] for r in m["shards"]] == ["shard-00000.safetensors"] and not m["complete"]
    assert set(_files(tmp_path / "h")) == {"shard-00000.safetensors"}

    monkeypatch.setattr(H, "save_file", real)
    done = H.extract_hidden_states(model, samples, IDS, tmp_path / "h", **KW)
    assert done.complete and done.shards == 3
    assert _files(tmp_path / "h") == _files(tmp_path / "full")
    assert H.read_manifest(tmp_path / "h")["shards"] == H.read_manifest(tmp_path / "full")["shards"]


def test_interrupt_during_a_forward_keeps_the_manifest_on_disk(model, tmp_path, monkeypatch, one_thread):
    """Ctrl-C in the main thread: the writer finishes the shard it is writing and drops the queued ones; the
    manifest lists only files on disk, and a resumed run gives the uninterrupted result."""
    samples = _samples(tmp_path / "samples.jsonl")
    H.extract_hidden_states(model, samples, IDS, tmp_path / "full", **KW)
    real, n = HK.target_forward_with_aux, []

    def interrupted(*args, **kwargs):
        n.append(1)
        if len(n) == 5:  # the first batch of the last shard
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(H, "target_forward_with_aux", interrupted)
    with pytest.raises(KeyboardInterrupt):
        H.extract_hidden_states(model, samples, IDS, tmp_path / "h", **KW)
    listed = [r["file"] for r in H.read_manifest(tmp_path / "h")["shards"]]
    assert listed == ["shard-00000.safetensors", "shard-00001.safetensors"][: len(listed)]
    assert all((tmp_path / "h" / f).is_file() for f in listed)
    monkeypatch.setattr(H, "target_forward_with_aux", real)
    H.extract_hidden_states(model, samples, IDS, tmp_path / "h", **KW)
    assert _files(tmp_path / "h") == _files(tmp_path / "full")
    assert H.read_manifest(tmp_path / "h")["shards"] == H.read_manifest(tmp_path / "full")["shards"]


def test_writes_overlap_the_next_shards_and_stay_bounded(model, tmp_path, monkeypatch, one_thread):
    """The write of shard 0 is held until shard 2 has been computed: a synchronous writer never gets there.
    The main thread never runs more than SHARDS_IN_FLIGHT shards ahead of the disk."""
    samples = _samples(tmp_path / "samples.jsonl", n=12)
    real_save, real_compute = safetensors.torch.save_file, H._compute_shard
    computed, written, ahead = [], [], []
    shard2_done = threading.Event()

    def compute(model, index, *args):
        ahead.append(len(computed) - len(written))  # shards computed but not yet on disk, before this one
        shard = real_compute(model, index, *args)
        computed.append(index)
        if index == 2:
            shard2_done.set()
        return shard

    def save(tensors, filename, metadata=None):
        if not written:
            assert shard2_done.wait(timeout=30), "shard 2 was not computed while shard 0 was being written"
        real_save(tensors, filename, metadata=metadata)
        written.append(filename)

    monkeypatch.setattr(H, "_compute_shard", compute)
    monkeypatch.setattr(H, "save_file", save)
    st = H.extract_hidden_states(model, samples, IDS, tmp_path / "h", **KW)
    assert st.complete and st.shards == 4 and computed == [0, 1, 2, 3]
    assert max(ahead) == H.SHARDS_IN_FLIGHT
