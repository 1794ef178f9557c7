"""Damaged files that a run reads back (a finished hidden-state shard, a saved target's weights) are errors that
name the file and say what to do, not safetensors' or transformers' messages, which name none. The training
checkpoint and the drafter's weights are tested beside their readers (test_train.py, test_drafter.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3lab.aux_states.shards import HiddenStateDataset, extract_hidden_states
from eagle3lab.errors import CorruptFileError, safetensors_problem
from eagle3lab.target_loading import load_target
from test_speculate import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _cut(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def test_safetensors_problem_reads_the_header_only(tmp_path: Path):
    from safetensors.torch import save_file

    f = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(64, 64)}, str(f))
    assert safetensors_problem(f) is None
    _cut(f, 0.9)
    assert "truncated" in safetensors_problem(f)
    f.write_bytes(b"\xff" * 64)
    assert "exceeds" in safetensors_problem(f)
    f.write_bytes(b"\x05" + b"\0" * 7 + b"{oops")
    assert "unreadable header" in safetensors_problem(f)


def test_a_corrupt_finished_shard_is_named_by_extraction_and_by_the_dataset(tmp_path: Path):
    model, _ = tiny_target(0)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"id": i, "prompt_ids": [1 + i, 2, 3], "output_ids": [4, 5, 6 + i]}) + "\n"
                               for i in range(4)))
    out = tmp_path / "hidden"
    kw = dict(shard_sequences=2, batch_size=2, progress=False)
    extract_hidden_states(model, samples, [1, 2, 4], out, max_shards=1, **kw)  # stopped after its first shard
    shard = out / "shard-00000.safetensors"
    _cut(shard)
    with pytest.raises(CorruptFileError) as err:  # resuming keeps finished shards: a damaged one is named
        extract_hidden_states(model, samples, [1, 2, 4], out, **kw)
    assert str(shard) in str(err.value) and "rerun 03_engine" in str(err.value)

    shard.unlink()
    (out / "manifest.json").unlink()
    extract_hidden_states(model, samples, [1, 2, 4], out, **kw)
    ds = HiddenStateDataset(out)
    assert len(ds) == 4 and ds[3]["aux"].shape[-1] == 3 * 32
    last = out / "shard-00001.safetensors"
    _cut(last)
    ds = HiddenStateDataset(out)
    ds[0]  # the intact shard still reads
    with pytest.raises(CorruptFileError, match="corrupt hidden-state shard") as err:
        ds[3]
    assert str(last) in str(err.value)


def test_a_corrupt_target_weights_file_is_named(tmp_path: Path):
    model, _ = tiny_target(0)
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    weights = folder / "model.safetensors"
    _cut(weights, 0.6)
    with pytest.raises(CorruptFileError, match="corrupt target weights file") as err:
        load_target(folder)
    assert str(weights) in str(err.value) and "truncated" in str(err.value)
