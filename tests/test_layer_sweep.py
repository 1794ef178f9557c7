"""Aux-layer ablation: the candidate sets, one extraction of every layer, per-set drafters on the same prompts."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lab import sweep as SW
from eagle3lab import synthetic as S
from eagle3lab import target as T
from eagle3lab.engines import factory as EF

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ablation_sets_for_small_and_large_targets():
    sets = {s.name: s for s in SW.ablation_sets(6, [1, 3, 5])}
    assert sets["profile"].ids == [1, 3, 5]
    assert sets["vLLM default (2, L//2, L-3)"].ids is None and "collapses" in sets["vLLM default (2, L//2, L-3)"].why
    shifted = [s for s in sets.values() if s.name.startswith("profile ids + 1")]
    assert shifted and shifted[0].ids == [2, 4, 6]  # ids - 1 would contain id 0
    assert sets["early"].ids == [1, 2, 3] and sets["late"].ids == [4, 5, 6]
    assert sets["middle"].ids == [2, 3, 4]
    kimi = {s.name: s.ids for s in SW.ablation_sets(61, [2, 30, 58])}
    # vLLM's default equals the profile's here: merged into one entry, named for both
    assert kimi["profile = vLLM default (2, L//2, L-3)"] == [2, 30, 58]
    assert kimi["profile ids - 1 (SGLang id read as vLLM id)"] == [1, 29, 57]
    assert kimi["late"] == [59, 60, 61]
    extra = SW.ablation_sets(6, [1, 3, 5], extra=[[6, 2]])
    assert extra[-1].ids == [2, 6]


class _AllLayers:
    aux_layer_ids = [1, 2, 3]
    hidden_size = 2

    def __len__(self):
        return 1

    def get(self, idx, keys=("input_ids", "loss_mask", "aux")):
        item = {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([False, True]),
                "aux": torch.tensor([[10.0, 11, 20, 21, 30, 31], [12, 13, 22, 23, 32, 33]])}
        return {k: v for k, v in item.items() if k in keys}


def test_selected_layers_picks_the_columns_of_each_id():
    view = SW.SelectedLayers(_AllLayers(), [3, 1])
    assert view.aux_layer_ids == [1, 3]
    assert view[0]["aux"].tolist() == [[10, 11, 30, 31], [12, 13, 32, 33]]
    assert "aux" not in view.get(0, ("input_ids",))
    with pytest.raises(ValueError, match="not stored"):
        SW.SelectedLayers(_AllLayers(), [4])


def test_sweep_extracts_once_trains_and_measures_each_choice(tmp_path):
    tpath = tmp_path / "target"
    T.build_embedded_target(T.tiny_spec(train_steps=6), tpath, seed=0)
    eng = EF.make_engine("reference", tpath, device="cpu")
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    samples = S.generate_samples(eng, prompts, tmp_path / "data", max_new_tokens=12, progress=False)
    heldout = prompts[:2]
    choices = [[4, 1], [2, 3]]
    res = SW.sweep_aux_layers(eng, samples, tpath, choices, heldout, tmp_path / "sweep", 2, 8, 64,
                              train_kw={"epochs": 1, "batch_size": 3, "progress": False}, seed=0)
    assert list(res) == ["[1, 4]", "[2, 3]"]  # ids sorted, order of the choices kept
    manifest = json.loads((tmp_path / "sweep" / "hidden-all" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 2, 3, 4]  # every layer, extracted once
    assert not list((tmp_path / "sweep").glob("hidden-[0-9]*"))
    for label, st in res.items():
        assert st.num_drafts > 0 and st.num_draft_tokens == 2 * st.num_drafts, label
        assert 1.0 <= st.mean_acceptance_length <= 3.0
        cfg = json.loads((tmp_path / "sweep" / f"drafter-{label[1:-1].replace(', ', '-')}" / "config.json").read_text())
        assert cfg["eagle_aux_hidden_state_layer_ids"] == json.loads(label)
    # The exact greedy replay over all-layer continuations gives the engine's own decoder counters.
    from eagle3lab.drafter import load_drafter
    from eagle3lab.speculate import forward_cost_ratio, greedy_continuations, replay_drafter

    dpath = tmp_path / "sweep" / "drafter-1-4"
    conts = greedy_continuations(eng, heldout + [[9, 10]], 8 + 3, [1, 2, 3, 4], batch_size=2)
    replayed = replay_drafter(load_drafter(dpath, "cpu"), conts, [1, 2, 3], 8, eng.eos_token_id)
    for k in (1, 2, 3):
        decoded = eng.speculative_generate(heldout + [[9, 10]], dpath, k, 8)
        assert [t.stats for t in replayed[k]] == decoded.per_prompt
        assert [t.output for t in replayed[k]] == decoded.outputs
    d, t, ratio = forward_cost_ratio(eng.model, load_drafter(dpath, "cpu"), conts[0].sequence, repeats=3)
    assert d > 0 and t > 0 and ratio == pytest.approx(d / t)
    # A drafter trained on selected columns equals one trained on a separate extraction of those ids.
    from eagle3lab.aux_states.shards import HiddenStateDataset, extract_hidden_states

    extract_hidden_states(eng.model, samples, [2, 3], tmp_path / "h23", progress=False)
    alone, all_sel = HiddenStateDataset(tmp_path / "h23"), SW.SelectedLayers(HiddenStateDataset(tmp_path / "sweep" / "hidden-all"), [2, 3])
    assert torch.allclose(alone[3]["aux"], all_sel[3]["aux"], atol=1e-5)
    with pytest.raises(ValueError, match="empty"):
        SW.sweep_aux_layers(eng, samples, tpath, [], heldout, tmp_path / "x", 2, 8, 64)


def test_budget_and_ablation_figure():
    from eagle3lab.acceptance import SpecDecodeStats, prompt_intervals

    kw = SW.budgeted({"max_steps": None, "warmup": 20, "epochs": 6, "lr": 1e-3}, 24)
    assert kw["max_steps"] == 24 and kw["warmup"] == 6 and kw["checkpoint_every"] == 24 and kw["lr"] == 1e-3
    assert SW.budgeted({"max_steps": 10}, 24)["max_steps"] == 10
    with pytest.raises(ValueError):
        SW.budgeted({}, 0)

    def iv(accepts):
        s = SpecDecodeStats()
        for a in accepts:
            s.record_round(3, a)
        return prompt_intervals([s, s], num_boot=50)

    fig = SW.ablation_figure({"profile": ([1, 3, 5], iv([3, 2])), "early": ([1, 2, 3], iv([1, 0]))}, 6, "profile")
    heat, bars = fig.data
    assert list(bars.y) == ["early [1, 2, 3]", "profile [1, 3, 5]"]  # ranked, best last (top of the chart)
    assert heat.z[1][0] == pytest.approx(3.5) and heat.z[1][1] is None  # profile uses id 1, not id 2
