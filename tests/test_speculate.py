"""Reference speculative decoder: identical to greedy decoding whatever the drafter, counters consistent."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from eagle3lab.drafter import build_drafter  # noqa: E402
from eagle3lab.speculate import greedy_generate, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(seed: int = 0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.5,
    )
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(cfg).eval(), cfg


def drafter_for(model, cfg, seed: int, lm_head: bool):
    counts = torch.randint(0, 10, (cfg.vocab_size,), generator=torch.Generator().manual_seed(seed))
    return build_drafter(
        cfg, [1, 2, 4], counts, 48, model.model.embed_tokens.weight.detach(),
        model.lm_head.weight.detach() if lm_head else None, seed=seed,
    ).eval()


@pytest.mark.parametrize("k", [1, 3])
def test_equals_greedy_on_random_prompts(k: int):
    model, cfg = tiny_target()
    g = torch.Generator().manual_seed(k)
    for trial in range(2):
        drafter = drafter_for(model, cfg, seed=trial, lm_head=trial == 0)
        prompt = torch.randint(0, cfg.vocab_size, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        n = 10 + trial
        ref = greedy_generate(model, prompt.tolist(), n)
        out, st = speculative_generate(model, drafter, prompt.tolist(), k, n, None)
        assert out == ref
        assert len(out) == n
        assert st.num_draft_tokens == k * st.num_drafts
        assert sum(st.accepted_hist) == st.num_drafts
        assert st.accepted_per_pos[0] <= st.num_drafts
        assert all(a >= b for a, b in zip(st.accepted_per_pos, st.accepted_per_pos[1:], strict=False))
        # Tokens produced: 1 from the prefill + (accepted + 1) per round, minus what the last round cut.
        assert st.num_drafts <= n - 1 < st.num_accepted_tokens + st.num_drafts + 1 + k


def test_perfect_drafter_accepts_everything():
    """A drafter that always proposes the target's greedy tokens is accepted in full (mean length k+1)."""
    model, cfg = tiny_target(1)
    drafter = drafter_for(model, cfg, 0, lm_head=False)
    prompt = [3, 5, 7]
    ref = greedy_generate(model, prompt, 13)

    def oracle(token_ids, aux, num_tokens):
        done = len(token_ids) - len(prompt)
        return ref[done : done + num_tokens] + [0] * max(0, num_tokens - len(ref[done:]))

    drafter.propose = oracle
    out, st = speculative_generate(model, drafter, prompt, 3, 13, None)
    assert out == ref
    assert st.num_drafts == 3 and st.num_accepted_tokens == 9  # 1 + 3 rounds x 4 tokens = 13
    assert st.mean_acceptance_length == 4.0
    assert st.per_position_rate == [1.0, 1.0, 1.0]


def test_stops_at_eos_and_bad_k():
    model, cfg = tiny_target(2)
    drafter = drafter_for(model, cfg, 1, lm_head=False)
    prompt = [1, 2, 3, 4]
    ref = greedy_generate(model, prompt, 10)
    eos = ref[4]
    out, _ = speculative_generate(model, drafter, prompt, 3, 10, eos)
    assert out == ref[: ref.index(eos) + 1]
    assert out == greedy_generate(model, prompt, 10, eos)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_generate(model, drafter, prompt, 0, 10, None)
