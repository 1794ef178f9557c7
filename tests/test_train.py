"""Drafter training with TTT: loss decreases, resume equals uninterrupted, bad inputs fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3lab.drafter import DrafterConfig, Eagle3Drafter, build_draft_vocab
from eagle3lab.train import accuracy_figure, collate, loss_figure, train_drafter, ttt_loss

V, H, NAUX = 40, 32, 2


pytestmark = pytest.mark.usefixtures("one_thread")


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items, aux_layer_ids=None):
        self.items = items
        if aux_layer_ids is not None:
            self.aux_layer_ids = aux_layer_ids

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_data(n: int = 12, seed: int = 0) -> ListDataset:
    """Learnable toy data: tokens follow x_{t+1} = (x_t * 3 + 1) % V, aux carries a one-hot of x_t."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        t = 10 + (i % 5)
        x = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(t - 1):
            x.append((x[-1] * 3 + 1) % V)
        ids = torch.tensor(x)
        aux = torch.randn(t, NAUX * H, generator=g) * 0.1
        aux[torch.arange(t), ids] += 1.0
        lm = torch.zeros(t, dtype=torch.bool)
        lm[3:] = True
        items.append({"input_ids": ids, "loss_mask": lm, "aux": aux})
    return ListDataset(items, aux_layer_ids=[1, 2])


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    cfg = DrafterConfig(vocab_size=V, draft_vocab_size=32, hidden_size=H, target_hidden_size=H,
                        aux_layer_ids=[1, 2], intermediate_size=64, num_attention_heads=4, num_key_value_heads=4)
    counts = torch.arange(V, 0, -1)
    d2t, t2d = build_draft_vocab(counts, 32)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg, d2t, t2d)
    torch.nn.init.normal_(d.embed_tokens.weight, std=0.5)
    return d


def test_collate_pads_and_masks():
    data = make_data(3)
    b = collate([data[0], data[1]])
    n0, n1 = data[0]["input_ids"].numel(), data[1]["input_ids"].numel()
    assert b["input_ids"].shape == (2, max(n0, n1))
    assert b["valid"].sum(1).tolist() == [n0, n1]
    assert not b["loss_mask"][1, n1:].any()
    assert collate([data[0]], max_seq_len=6)["input_ids"].shape == (1, 6)


def test_ttt_loss_decreases_on_fixed_batch():
    d = make_drafter()
    batch = collate([make_data(4)[i] for i in range(4)])
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss, losses, accs = ttt_loss(d, batch, ttt_steps=3, ttt_decay=0.8)
        assert len(losses) == 3 and len(accs) == 3
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
    final, _, accs = ttt_loss(d, batch, 3, 0.8)
    assert float(final.detach()) < 0.3 * first
    assert accs[0] > 0.8  # the rule is deterministic, so the first draft position becomes right


def test_ttt_total_is_decayed_sum():
    d = make_drafter()
    batch = collate([make_data(2)[i] for i in range(2)])
    total, losses, _ = ttt_loss(d, batch, 3, 0.5)
    assert abs(float(total) - (losses[0] + 0.5 * losses[1] + 0.25 * losses[2])) < 1e-5


def test_shared_embeddings_stay_frozen():
    d = make_drafter()
    before = d.embed_tokens.weight.clone()
    train_drafter(d, make_data(8), epochs=1, batch_size=4, progress=False)
    assert torch.equal(before, d.embed_tokens.weight)


def test_resume_equals_uninterrupted(tmp_path: Path):
    kw = dict(ttt_steps=2, epochs=3, batch_size=4, lr=2e-3, warmup=2, checkpoint_every=2, seed=5, progress=False)
    data = make_data(10)  # 3 batches per epoch, 9 steps
    a = make_drafter()
    ra = train_drafter(a, data, checkpoint_dir=tmp_path / "a", **kw)
    b = make_drafter()
    rb1 = train_drafter(b, data, checkpoint_dir=tmp_path / "b", stop_after=5, **kw)
    assert rb1.steps == 5
    b2 = make_drafter(seed=123)  # a fresh process: different init, everything comes from the checkpoint
    rb = train_drafter(b2, data, checkpoint_dir=tmp_path / "b", **kw)
    assert rb.resumed_from == 5 and rb.steps == ra.steps == 9
    assert rb.losses == ra.losses
    assert rb.accuracies == ra.accuracies
    for k, v in a.state_dict().items():
        assert torch.equal(v, b2.state_dict()[k]), k
    # Figures render from the history.
    assert len(loss_figure(rb).data) == 1 + 2
    assert len(accuracy_figure(rb).data) == 2


def test_resume_with_other_settings_refused(tmp_path: Path):
    data = make_data(4)
    train_drafter(make_drafter(), data, epochs=1, batch_size=2, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train_drafter(make_drafter(), data, epochs=1, batch_size=2, lr=5e-3, checkpoint_dir=tmp_path, progress=False)


def test_checkpoint_of_other_data_is_never_resumed(tmp_path: Path):
    """A finished drafter on hidden states of another target/samples (another dataset fingerprint) is
    refused, saying what changed, or retrained from scratch; never silently reused."""
    old, new = make_data(4), make_data(4, seed=1)
    old.fingerprint, new.fingerprint = "states-of-target-A", "states-of-target-B"
    kw = dict(epochs=1, batch_size=2, checkpoint_dir=tmp_path, progress=False)
    first = train_drafter(make_drafter(), old, **kw)
    with pytest.raises(ValueError, match="data changed"):
        train_drafter(make_drafter(), new, **kw)
    again = train_drafter(make_drafter(), new, on_mismatch="restart", **kw)
    assert again.resumed_from == 0 and again.steps == first.steps
    assert again.losses != first.losses  # trained on the new data, not read back from the old checkpoint
    assert train_drafter(make_drafter(), new, **kw).resumed_from == again.steps  # now it matches: resumed


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        train_drafter(make_drafter(), ListDataset([]), progress=False)
    bad = make_data(2)
    for it in bad.items:
        it["aux"] = it["aux"][:, :H]
    with pytest.raises(ValueError, match="aux width 32 does not match"):
        train_drafter(make_drafter(), bad, progress=False)
    other_ids = make_data(2)
    other_ids.aux_layer_ids = [1, 3]
    with pytest.raises(ValueError, match="aux_layer_ids"):
        train_drafter(make_drafter(), other_ids, progress=False)


def test_train_drafter_for_target_reads_target_folder(tmp_path: Path):
    import json

    from safetensors.torch import save_file

    from eagle3lab.train import train_drafter_for_target

    emb, head = torch.randn(V, H), torch.randn(V, H)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": H, "intermediate_size": 48}))
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    d, r = train_drafter_for_target(tmp_path, make_data(4), 16, train_kw={"epochs": 1, "batch_size": 2, "progress": False})
    assert r.steps == 2 and d.config.aux_layer_ids == [1, 2] and d.config.draft_vocab_size == 16
    from eagle3lab.train import build_drafter_for_target

    _, cov = build_drafter_for_target(tmp_path, make_data(4), 16)
    assert cov.target_vocab == V and cov.draft_vocab == 16 and 0 < cov.coverage <= 1
    assert d.config.intermediate_size == 48 and d.config.shared_embeddings
    assert torch.equal(d.embed_tokens.weight, emb)  # shared and frozen


def test_accuracy_summary_follows_the_numbers():
    from eagle3lab.train import accuracy_summary

    assert accuracy_summary([0.937, 0.936, 0.934]).startswith("accuracy is nearly flat")
    assert accuracy_summary([0.9, 0.8, 0.7]).startswith("accuracy falls from 0.900")
    assert accuracy_summary([0.5, 0.6, 0.7]).startswith("accuracy rises")
    assert accuracy_summary([0.031, 0.0, 0.016]).startswith("accuracy is low at every position")
    assert "0.937 / 0.936 / 0.934" in accuracy_summary([0.937, 0.936, 0.934])


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a checkpoint"])
def test_corrupt_training_checkpoint_is_named(tmp_path: Path, damage: str):
    """A train state that torch cannot read (cut short, overwritten) or that holds something else is an error
    naming the file and what to do, not torch's zip-reader message naming none."""
    from eagle3lab.errors import CorruptFileError
    from eagle3lab.train import CKPT_NAME

    data = make_data(4)
    kw = dict(epochs=1, batch_size=2, checkpoint_dir=tmp_path, progress=False)
    train_drafter(make_drafter(), data, **kw)
    ckpt = tmp_path / CKPT_NAME
    raw = ckpt.read_bytes()
    if damage == "truncated":
        ckpt.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        ckpt.write_bytes(b"\0" * 64 + raw[64:])
    else:
        torch.save({"step": 3}, ckpt)
    with pytest.raises(CorruptFileError) as err:
        train_drafter(make_drafter(), data, **kw)
    assert str(ckpt) in str(err.value) and "delete it to train from scratch" in str(err.value)
