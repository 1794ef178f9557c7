"""The online route (aux states computed per training batch, nothing stored) against the offline shards."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lab import target as T
from eagle3lab.aux_states import shards as H
from eagle3lab.aux_states.online import OnlineAuxStates
from eagle3lab.drafter import build_drafter
from eagle3lab.train import token_counts_from_dataset, train_drafter

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [1, 2, 4]


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 320


@pytest.fixture(scope="module")
def model():
    return T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0).eval()


@pytest.fixture
def samples(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "samples.jsonl"
    with open(path, "w") as f:
        for i in range(10):
            p = torch.randint(3, 320, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
            o = torch.randint(3, 320, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"id": i, "prompt_ids": p, "output_ids": o}) + "\n")
    return path


class _Counting(H.ModelAuxSource):
    """A source that counts the target's forwards, to see which calls run the target."""

    calls = 0

    def aux_batch(self, seqs, aux_layer_ids):
        type(self).calls += 1
        return super().aux_batch(seqs, aux_layer_ids)


def test_items_equal_the_offline_shards(model, samples, tmp_path):
    H.extract_hidden_states(model, samples, AUX, tmp_path / "hidden", shard_sequences=4, batch_size=3, progress=False)
    offline = H.HiddenStateDataset(tmp_path / "hidden")
    online = OnlineAuxStates(H.ModelAuxSource(model), samples, AUX)
    assert len(online) == len(offline) == 10
    assert online.aux_layer_ids == offline.aux_layer_ids and online.hidden_size == offline.hidden_size
    got = online.get_batch([7, 2, 5])  # another batch composition than the extraction's
    for item, i in zip(got, (7, 2, 5), strict=True):
        want = offline[i]
        assert torch.equal(item["input_ids"], want["input_ids"])
        assert torch.equal(item["loss_mask"], want["loss_mask"])
        assert item["aux"].shape == want["aux"].shape
        # float32 both ways: only the padding of the batch may change the last bits
        assert torch.allclose(item["aux"], want["aux"], rtol=1e-5, atol=1e-5)
    assert online.forward_tokens == sum(len(got[r]["input_ids"]) for r in range(3))
    assert online.forward_seconds > 0


def test_token_statistics_run_no_forward(model, samples):
    src = _Counting(model)
    _Counting.calls = 0
    online = OnlineAuxStates(src, samples, AUX)
    counts = token_counts_from_dataset(online, 320)
    assert _Counting.calls == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert int(counts.sum()) == sum(len(r["output_ids"]) for r in rows)  # response tokens only
    online.get(3)
    assert _Counting.calls == 1


def test_storage_dtype_rounds_like_the_shards(model, samples, tmp_path):
    H.extract_hidden_states(model, samples, AUX, tmp_path / "h16", dtype="bfloat16", progress=False)
    offline = H.HiddenStateDataset(tmp_path / "h16")
    online = OnlineAuxStates(H.ModelAuxSource(model), samples, AUX, dtype="bfloat16")
    a, b = online.get(4)["aux"], offline[4]["aux"]
    assert torch.equal(a.to(torch.bfloat16).float(), a)  # representable in bfloat16: it was rounded
    # the same float32 states rounded once: equal, or one bfloat16 step apart where the float32 values straddle a tie
    assert (a - b).abs().max() <= b.abs().max() * 2**-7


def test_training_online_matches_offline(model, samples, tmp_path):
    """Same samples, seed and settings: the drafter trained on computed states ends where the stored ones take it."""
    H.extract_hidden_states(model, samples, AUX, tmp_path / "hidden", progress=False)
    offline = H.HiddenStateDataset(tmp_path / "hidden")
    online = OnlineAuxStates(H.ModelAuxSource(model), samples, AUX)

    def drafter():
        counts = token_counts_from_dataset(offline, 320)
        emb = model.get_input_embeddings().weight.detach()
        return build_drafter(model.config, AUX, counts, 64, emb, model.lm_head.weight.detach(), seed=0)

    kw = {"epochs": 3, "batch_size": 4, "lr": 3e-3, "warmup": 2, "seed": 0, "progress": False}
    a, b = drafter(), drafter()
    ra = train_drafter(a, offline, **kw)
    rb = train_drafter(b, online, **kw)
    assert ra.steps == rb.steps == 9
    assert ra.losses[-1] < ra.losses[0]
    assert max(abs(x - y) for x, y in zip(ra.losses, rb.losses, strict=True)) < 1e-3
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(pa.float(), pb.float(), rtol=1e-3, atol=1e-4), name
    # each epoch ran the target over every sequence once: the online route's price
    assert online.forward_tokens == 3 * sum(len(online.get(i, ("input_ids",))["input_ids"]) for i in range(10))


def test_fingerprints_name_the_route_and_the_data(model, samples, tmp_path):
    H.extract_hidden_states(model, samples, AUX, tmp_path / "hidden", progress=False)
    online = OnlineAuxStates(H.ModelAuxSource(model), samples, AUX)
    assert online.fingerprint != H.HiddenStateDataset(tmp_path / "hidden").fingerprint
    assert online.fingerprint == OnlineAuxStates(H.ModelAuxSource(model), samples, AUX).fingerprint
    assert online.fingerprint != OnlineAuxStates(H.ModelAuxSource(model), samples, [1, 2, 3]).fingerprint


def test_bad_inputs(model, samples, tmp_path):
    with pytest.raises(ValueError, match="aux"):
        OnlineAuxStates(H.ModelAuxSource(model), samples, [99])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no samples"):
        OnlineAuxStates(H.ModelAuxSource(model), empty, AUX)
    with pytest.raises(ValueError, match="dtype"):
        OnlineAuxStates(H.ModelAuxSource(model), samples, AUX, dtype="int8")
    with pytest.raises(IndexError):
        OnlineAuxStates(H.ModelAuxSource(model), samples, AUX).get(10)
