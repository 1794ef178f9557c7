"""params -> kwargs: every key is a parameter of the function it is meant for, and values come from the profile."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from eagle3lab import params
from eagle3lab.kwargs import drafter_kwargs, extraction_kwargs, train_kwargs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile():
    return params.load(ROOT / "tests" / "smoke.yaml", ["train.epochs=3", "train.learning_rate=0.002"])


def _accepts(func, kwargs):
    sig = inspect.signature(func)
    unknown = set(kwargs) - set(sig.parameters)
    assert not unknown, f"{func.__qualname__} has no parameters {sorted(unknown)}"
    sig.bind_partial(**kwargs)


def test_keys_match_the_called_signatures(profile):
    from eagle3lab.aux_states.shards import extract_hidden_states
    from eagle3lab.drafter import build_drafter
    from eagle3lab.train import train_drafter

    _accepts(build_drafter, drafter_kwargs(profile))
    _accepts(train_drafter, train_kwargs(profile, device="cpu", checkpoint_dir="/tmp/x"))
    _accepts(extract_hidden_states, extraction_kwargs(profile))


def test_values_come_from_the_profile(profile):
    kw = train_kwargs(profile)
    assert kw["epochs"] == 3 and kw["lr"] == 0.002 and kw["batch_size"] == profile.train.batch_size
    assert "checkpoint_dir" not in kw and "seed" not in kw
    assert drafter_kwargs(profile)["num_attention_heads"] == 2
    assert extraction_kwargs(profile) == {"shard_sequences": 8, "dtype": "float32", "batch_size": 8, "progress": True}
