"""Acceptance per choice of target layers: one drafter per choice, measured on the same prompts."""

from __future__ import annotations

import json

import pytest

from eagle3lab import acceptance as A
from eagle3lab import engine as E
from eagle3lab import synthetic as S
from eagle3lab import target as T

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sweep_trains_and_measures_each_choice(tmp_path):
    tpath = tmp_path / "target"
    T.build_embedded_target(T.tiny_spec(train_steps=6), tpath, seed=0)
    eng = E.make_engine("reference", tpath, device="cpu")
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    samples = S.generate_samples(eng, prompts, tmp_path / "data", max_new_tokens=12, progress=False)
    heldout = prompts[:2]
    choices = [[4, 1], [2, 3]]
    res = A.sweep_aux_layers(eng, samples, tpath, choices, heldout, tmp_path / "sweep", 2, 8, 64,
                             train_kw={"epochs": 1, "batch_size": 3, "progress": False}, seed=0)
    assert list(res) == ["[1, 4]", "[2, 3]"]  # ids sorted, order of the choices kept
    for label, st in res.items():
        assert st.num_drafts > 0 and st.num_draft_tokens == 2 * st.num_drafts, label
        assert 1.0 <= st.mean_acceptance_length <= 3.0
        cfg = json.loads((tmp_path / "sweep" / f"drafter-{label[1:-1].replace(', ', '-')}" / "config.json").read_text())
        assert cfg["eagle_aux_hidden_state_layer_ids"] == json.loads(label)
    with pytest.raises(ValueError, match="empty"):
        A.sweep_aux_layers(eng, samples, tpath, [], heldout, tmp_path / "x", 2, 8, 64)
