"""Layer probe: logit lens and tuned lens per layer id."""

from __future__ import annotations

import pytest
import torch

from eagle3lab import probe as PR

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_final_state_is_the_target_and_the_tuned_lens_learns():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from eagle3lab.aux_states.hooks import target_forward_with_aux
    from test_speculate import tiny_target

    model, cfg = tiny_target(0)
    g = torch.Generator().manual_seed(0)
    ids = list(range(1, cfg.num_hidden_layers + 1))
    seqs = torch.randint(0, cfg.vocab_size, (6, 40), generator=g)
    out = target_forward_with_aux(model, seqs, ids)
    readout = PR.readout_from_model(model)
    aux = out.aux.reshape(-1, out.aux.shape[-1])
    states, labels = PR.states_and_labels(aux, ids, cfg.hidden_size, readout, cfg.num_hidden_layers)
    # The final pre-norm state through the target's norm and lm_head is exactly the target's prediction.
    assert torch.equal(labels, out.logits.reshape(-1, cfg.vocab_size).argmax(-1))
    tr, ev = slice(0, 160), slice(160, 240)
    res = PR.probe_layers(ids, states[tr], labels[tr], states[ev], labels[ev], readout, top_k=5, steps=150,
                          batch_size=64, lr=1e-2)
    assert res.lens_top1[-1] == 1.0 and res.tuned_top1[-1] >= 0.95
    assert all(a >= b for a, b in zip(res.lens_topk, res.lens_top1, strict=True))
    # Trained on the same layer's states, the translator does better than none on held-out tokens.
    assert res.tuned_top1[0] > res.lens_top1[0]
    fig = PR.probe_figure(res, [1, 2, 4])
    assert len(fig.data) == 3
    with pytest.raises(ValueError, match="final state"):
        PR.states_and_labels(aux[:, : 2 * cfg.hidden_size], [1, 2], cfg.hidden_size, readout, cfg.num_hidden_layers)


def test_sample_states_takes_response_tokens():
    class DS:
        def __len__(self):
            return 3

        def get(self, i, keys):
            # row t of sequence i holds 10 * i + t: a row's value says which sequence and position it came from
            aux = (10 * i + torch.arange(3.0))[:, None].expand(3, 2)
            return {"loss_mask": torch.tensor([False, True, True]), "aux": aux}

    rows = PR.sample_states(DS(), 5, seed=0)
    assert rows.shape == (5, 2)
    # only response positions (1 and 2), never the prompt's position 0, whole sequences in turn
    assert {int(v) % 10 for v in rows[:, 0].tolist()} == {1, 2}
    assert len({int(v) // 10 for v in rows[:, 0].tolist()}) == 3
    everything = PR.sample_states(DS(), 100)  # all response tokens of all sequences, each once
    assert sorted(everything[:, 0].tolist()) == [1.0, 2.0, 11.0, 12.0, 21.0, 22.0]
