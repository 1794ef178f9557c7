"""Aux hidden states in vLLM's convention, and their resumable extraction to disk."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lab import target as T
from eagle3lab.aux_states import hooks as HK
from eagle3lab.aux_states import shards as H


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 320


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0).eval()
    return m


def _samples(path, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            p = torch.randint(3, 320, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
            o = torch.randint(3, 320, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"id": i, "prompt_ids": p, "output_ids": o}) + "\n")
    return path


def test_shapes_and_ascending_order(model):
    x = torch.randint(3, 320, (2, 9))
    out = HK.target_forward_with_aux(model, x, [4, 1, 2])
    h = model.config.hidden_size
    assert out.aux_layer_ids == [1, 2, 4]
    assert out.logits.shape == (2, 9, 320) and out.logits.dtype == torch.float32
    assert out.aux.shape == (2, 9, 3 * h)
    single = HK.target_forward_with_aux(model, x, [2]).aux
    assert torch.equal(out.aux[..., h : 2 * h], single)


def test_without_logits_the_forward_stops_at_the_last_aux_layer(model):
    """Extraction needs no logits: the forward ends at the highest aux id's capture, with the same states."""
    x = torch.randint(3, 320, (2, 9))
    full = HK.target_forward_with_aux(model, x, [1, 2])
    reached: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: reached.append(i))
             for i, layer in enumerate(model.model.layers)]
    head = model.lm_head.register_forward_pre_hook(lambda m, a: reached.append(-1))
    try:
        short = HK.target_forward_with_aux(model, x, [1, 2], logits=False)
    finally:
        for h in (*hooks, head):
            h.remove()
    assert short.logits is None and torch.equal(short.aux, full.aux)
    assert reached == [0, 1, 2]  # layer 2's input is the last state wanted: no later layer, no LM head
    n = model.config.num_hidden_layers  # the final norm's input: every layer runs, the head does not
    assert torch.equal(HK.target_forward_with_aux(model, x, [n], logits=False).aux,
                       HK.target_forward_with_aux(model, x, [n]).aux)


def test_hand_computation_of_one_layer(model):
    # id 2 is the input of layer 2 = output of layer 1 applied to the id-1 state.
    x = torch.randint(3, 320, (1, 7))
    out = HK.target_forward_with_aux(model, x, [1, 2])
    h = model.config.hidden_size
    s1, s2 = out.aux[..., :h], out.aux[..., h:]
    inner = model.model
    pos = torch.arange(7)[None]
    mask = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        by_hand = inner.layers[1](s1, attention_mask=mask, position_ids=pos,
                                  position_embeddings=inner.rotary_emb(s1, pos))  # fmt: skip
    by_hand = by_hand[0] if isinstance(by_hand, tuple) else by_hand
    assert torch.allclose(by_hand, s2, atol=1e-5)
    assert not torch.allclose(s1, s2)  # the layer did something


def test_last_id_is_pre_norm(model):
    x = torch.randint(3, 320, (2, 6))
    n = model.config.num_hidden_layers
    out = HK.target_forward_with_aux(model, x, [n])
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(out.aux))
    assert torch.allclose(logits, out.logits, atol=1e-5)
    # transformers' own last hidden state is post-norm: it must differ from ours.
    last = model(input_ids=x, output_hidden_states=True).hidden_states[-1]
    assert not torch.allclose(last, out.aux, atol=1e-3)


@pytest.mark.parametrize("ids", [[0, 2], [1, 5], [-1], [], [2, 2]])
def test_bad_ids_rejected(model, ids):
    with pytest.raises(ValueError, match="aux_layer_ids"):
        HK.target_forward_with_aux(model, torch.zeros(1, 3, dtype=torch.long), ids)


def test_verify_mapping_with_right_padding(model):
    x = torch.randint(3, 320, (2, 8))
    mask = torch.ones_like(x)
    mask[1, 5:] = 0
    assert HK.verify_aux_mapping(model, x, [1, 3, 4], relative=True) < HK.AUX_AGREEMENT_TOL
    assert HK.verify_aux_mapping(model, x, [1, 3, 4], mask, relative=True) < HK.AUX_AGREEMENT_TOL


def test_agreement_tolerance_catches_a_one_layer_shift(model, monkeypatch):
    """The tolerance separates rounding from a wrong mapping: capturing the output of layer k (SGLang's
    convention) instead of its input must fail the check by orders of magnitude."""
    x = torch.randint(3, 320, (2, 8))
    real = HK.target_forward_with_aux

    def shifted(m, ids, aux_ids, mask=None):
        out = real(m, ids, [i + 1 for i in aux_ids], mask)
        return HK.TargetOutput(out.logits, out.aux, list(aux_ids))

    monkeypatch.setattr(HK, "target_forward_with_aux", shifted)
    assert HK.verify_aux_mapping(model, x, [1, 2], relative=True) > 100 * HK.AUX_AGREEMENT_TOL


def _shard_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard-*.safetensors"))}


def test_extraction_resume_is_identical(model, tmp_path):
    samples = _samples(tmp_path / "samples.jsonl")
    full = H.extract_hidden_states(model, samples, [1, 4], tmp_path / "a", shard_sequences=3, batch_size=2,
                                   progress=False)  # fmt: skip
    assert full.complete and full.shards == 3 and full.sequences == 7
    # Interrupted after one shard, with a torn temp file left behind, then resumed.
    part = H.extract_hidden_states(model, samples, [1, 4], tmp_path / "b", shard_sequences=3, batch_size=2,
                                   progress=False, max_shards=1)  # fmt: skip
    assert not part.complete and part.shards == 1
    with pytest.raises(ValueError, match="incomplete"):
        H.HiddenStateDataset(tmp_path / "b")
    assert len(H.HiddenStateDataset(tmp_path / "b", allow_incomplete=True)) == 3
    (tmp_path / "b" / "shard-00001.safetensors.tmp").write_bytes(b"garbage")
    done = H.extract_hidden_states(model, samples, [1, 4], tmp_path / "b", shard_sequences=3, batch_size=2,
                                   progress=False)  # fmt: skip
    assert done.complete and done.sequences == 7 and done.tokens == full.tokens
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b")
    ma, mb = H.read_manifest(tmp_path / "a"), H.read_manifest(tmp_path / "b")
    assert ma["shards"] == mb["shards"] and mb["complete"]
    assert done.bytes_per_token == pytest.approx(full.bytes_per_token)


def test_dataset_matches_forward_and_mask(model, tmp_path):
    samples = _samples(tmp_path / "samples.jsonl", n=4)
    H.extract_hidden_states(model, samples, [2, 4], tmp_path / "h", shard_sequences=3, batch_size=3, progress=False)
    ds = H.HiddenStateDataset(tmp_path / "h")
    assert len(ds) == 4 and ds.aux_layer_ids == [2, 4] and ds.hidden_size == 32
    recs = [json.loads(line) for line in samples.read_text().splitlines()]
    for k in (0, 3):
        item = ds[k]
        seq = recs[k]["prompt_ids"] + recs[k]["output_ids"]
        assert item["input_ids"].tolist() == seq
        assert item["loss_mask"].dtype == torch.bool
        assert item["loss_mask"].tolist() == [False] * len(recs[k]["prompt_ids"]) + [True] * len(recs[k]["output_ids"])
        ref = HK.target_forward_with_aux(model, torch.tensor([seq]), [2, 4]).aux[0]
        assert torch.allclose(item["aux"], ref, atol=1e-5)
    toks = list(H.iter_token_ids(tmp_path / "h"))
    assert sum(len(t) for t, _ in toks) == sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in recs)


def test_extraction_bf16_and_errors(model, tmp_path):
    samples = _samples(tmp_path / "samples.jsonl", n=3)
    s32 = H.extract_hidden_states(model, samples, [1, 2], tmp_path / "f32", progress=False)
    s16 = H.extract_hidden_states(model, samples, [1, 2], tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert s16.bytes < 0.7 * s32.bytes
    with pytest.raises(ValueError, match="dtype changed"):
        H.extract_hidden_states(model, samples, [1, 2], tmp_path / "f32", dtype="bfloat16", progress=False,
                                on_stale="refuse")
    with pytest.raises(ValueError, match="aux_layer_ids"):
        H.extract_hidden_states(model, samples, [0, 2], tmp_path / "x", progress=False)
    with pytest.raises(FileNotFoundError):
        H.HiddenStateDataset(tmp_path / "nowhere")


def test_changed_inputs_are_never_resumed(model, tmp_path):
    """Provenance: other samples or another target make a finished extraction stale; it is redone (saying
    which input changed) or refused, never resumed."""
    samples = _samples(tmp_path / "samples.jsonl", n=5)
    first = H.extract_hidden_states(model, samples, [1, 2], tmp_path / "h", shard_sequences=2, progress=False)
    assert first.complete and first.rebuilt is None
    again = H.extract_hidden_states(model, samples, [1, 2], tmp_path / "h", shard_sequences=2, progress=False)
    assert again.rebuilt is None and again.tokens == first.tokens  # same inputs: resumed (nothing to do)
    fp = H.HiddenStateDataset(tmp_path / "h").fingerprint

    other_target = T.build_model(model.config, seed=1).eval()  # same shapes, other weights
    with pytest.raises(ValueError, match="target_weights changed"):
        H.extract_hidden_states(other_target, samples, [1, 2], tmp_path / "h", shard_sequences=2,
                                progress=False, on_stale="refuse")
    redo = H.extract_hidden_states(other_target, samples, [1, 2], tmp_path / "h", shard_sequences=2, progress=False)
    assert redo.complete and "target_weights" in redo.rebuilt
    ds = H.HiddenStateDataset(tmp_path / "h")
    assert ds.fingerprint != fp
    seq = torch.tensor([ds[0]["input_ids"].tolist()])
    assert torch.allclose(ds[0]["aux"], HK.target_forward_with_aux(other_target, seq, [1, 2]).aux[0], atol=1e-5)

    _samples(samples, n=5, seed=9)  # regenerated samples, same ids
    redo = H.extract_hidden_states(other_target, samples, [1, 2], tmp_path / "h", shard_sequences=2, progress=False)
    assert redo.rebuilt is not None and "samples_sha256" in redo.rebuilt
