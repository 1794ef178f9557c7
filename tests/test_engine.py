"""The reference engine: deterministic greedy generation, EOS handling, clear errors."""

from __future__ import annotations

import pytest
import torch

from eagle3lab import target as T
from eagle3lab.engines import base as EB
from eagle3lab.engines import factory as EF
from eagle3lab.engines import reference as ER
from eagle3lab.engines import vllm_offline as EO


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    T.build_embedded_target(T.tiny_spec(train_steps=6), path, seed=0)
    return EF.make_engine("reference", path, device="cpu")


def _greedy_by_recomputation(model, prompt, n, eos):
    # Full recomputation without any cache: what KV-cached generation must equal.
    seq, out = list(prompt), []
    with torch.no_grad():
        while len(out) < n:
            tok = int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok == eos:
                break
    return out


@pytest.mark.parametrize("impl", [ER.ReferenceEngine, EO.VllmEngine], ids=lambda c: c.__name__)
def test_engines_take_the_protocols_arguments(impl):
    """Every engine accepts the Protocol's parameters, by the same names, in the same order, with the same
    defaults (a runtime_checkable isinstance only looks at method names), so notebooks can swap engines."""
    import inspect

    for name in ("generate", "speculative_generate"):
        want = list(inspect.signature(getattr(EB.Engine, name)).parameters.values())
        have = inspect.signature(getattr(impl, name)).parameters
        for p in want:
            assert p.name in have, f"{impl.__name__}.{name} lacks parameter {p.name!r}"
            assert have[p.name].default == p.default, f"{impl.__name__}.{name}({p.name}=...) default differs"
        assert [q for q in have if q in {p.name for p in want}] == [p.name for p in want], f"{name}: order differs"


def test_greedy_deterministic_and_exact(eng):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44], [100, 7, 9, 11, 12]]
    a = eng.generate(prompts, 12)
    b = eng.generate(prompts, 12)
    assert a == b and len(a) == 3
    for p, out in zip(prompts, a, strict=True):
        assert 1 <= len(out) <= 12
        assert out == _greedy_by_recomputation(eng.model, p, 12, eng.eos_token_id)
    # A prompt's output does not depend on its batch mates (equal lengths: no padding).
    assert eng.generate(prompts[1:2], 12)[0] == a[1]


def test_left_padded_batch_matches_single(eng):
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45]]
    batch = eng.generate(prompts, 8)
    assert batch[0] == eng.generate([prompts[0]], 8)[0]
    assert batch[1] == eng.generate([prompts[1]], 8)[0]


def test_sampling_reproducible_under_seed(eng):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    a = eng.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    b = eng.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    assert a == b


def test_sampling_follows_temperature(eng):
    """Temperature reaches the sampler: near 0 it is greedy decoding, high it is not (nor one seed's copy of
    another's). A sampler that ignores temperature fails one side: always greedy, or always T = 1."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [100, 7, 9, 11]]
    greedy = eng.generate(prompts, 10)
    # At T = 1e-4 a logit gap of 0.01 becomes a factor e^100: only an exact tie could leave the argmax.
    assert eng.generate(prompts, 10, temperature=1e-4, seed=3) == greedy
    hot = [eng.generate(prompts, 10, temperature=20.0, seed=s) for s in (3, 4)]
    assert all(h != greedy for h in hot) and hot[0] != hot[1]


def test_cut_at_eos():
    assert EB.cut_at_eos([4, 5, 1, 2, 2], 1) == [4, 5, 1]
    assert EB.cut_at_eos([4, 5], 1) == [4, 5]
    assert EB.cut_at_eos([4, 1], None) == [4, 1]


def test_errors(eng, tmp_path):
    with pytest.raises(ValueError, match="empty prompt set"):
        eng.generate([], 4)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[1, 2], []], 4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        EF.make_engine("vllm", tmp_path)  # an empty folder is refused before vLLM is started
    with pytest.raises(ValueError, match="expected"):
        EF.make_engine("sglang", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EF.make_engine("reference", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="drafter"):
        eng.speculative_generate([[1, 2]], tmp_path / "no-drafter", 3, 4)
