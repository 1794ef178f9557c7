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


# ---------------------------------------------------------------------------------------------------------
# exact greedy replay


@pytest.fixture(scope="module")
def trained_pair():
    """A tiny target and a drafter trained briefly on its greedy continuations: partial acceptance, so that
    replay-vs-decoder comparisons see accepted AND rejected drafts."""
    from eagle3lab.aux_states.hooks import target_forward_with_aux
    from eagle3lab.train import train_drafter

    torch.set_num_threads(1)
    model, cfg = tiny_target(3)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(12):
        prompt = torch.randint(0, cfg.vocab_size, (4,), generator=g).tolist()
        seq = prompt + greedy_generate(model, prompt, 20)
        aux = target_forward_with_aux(model, torch.tensor([seq]), [1, 2, 4]).aux[0]
        lm = torch.zeros(len(seq), dtype=torch.bool)
        lm[4:] = True
        data.append({"input_ids": torch.tensor(seq), "loss_mask": lm, "aux": aux})
    drafter = drafter_for(model, cfg, 0, lm_head=True)
    train_drafter(drafter, data, ttt_steps=3, epochs=15, batch_size=4, lr=3e-3, warmup=2, progress=False)
    return model, cfg, drafter.eval()


def test_replay_equals_decoder_for_every_k(trained_pair):
    from eagle3lab.speculate import aux_and_logits, chain_predictions, replay_greedy, speculative_decode

    model, cfg, drafter = trained_pair
    g = torch.Generator().manual_seed(5)
    accepted = rejected = 0
    for _ in range(4):
        prompt = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
        n = 14
        seq = prompt + greedy_generate(model, prompt, n + 7)
        preds = chain_predictions(drafter, torch.tensor(seq), aux_and_logits(model, seq, [1, 2, 4]).aux[0], 7)
        for k in range(1, 8):
            dec = speculative_decode(model, drafter, prompt, k, n, None)
            rep = replay_greedy(seq, len(prompt), preds, k, n)
            assert rep.output == dec.output == seq[len(prompt) : len(prompt) + n]
            assert rep.stats == dec.stats, k
            for a, b in zip(dec.rounds, rep.rounds, strict=True):
                assert (a.start, a.accepted, a.emitted) == (b.start, b.accepted, b.emitted)
                assert a.drafted[: len(b.drafted)] == b.drafted  # replay knows drafts up to the first rejection
            accepted += dec.stats.num_accepted_tokens
            rejected += dec.stats.num_draft_tokens - dec.stats.num_accepted_tokens
    assert accepted > 0 and rejected > 0, "the comparison must see both outcomes"


def test_replay_needs_enough_tokens_and_ngram_lookup():
    from eagle3lab.speculate import ngram_predictions, replay_greedy

    seq = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    ng = ngram_predictions(seq, 3)
    assert ng.shape == (9, 3)
    assert ng[0].tolist() == [-1, -1, -1]  # context [1, 2]: nothing seen before
    assert ng[2].tolist() == [2, 3, 1]  # context [1, 2, 3, 1]: the 1 at index 0 was followed by 2, 3, 1
    assert ng[4].tolist() == [1, 2, 3]  # context ..3, 1, 2, 3: longest match [1, 2, 3] at index 0 -> 1, 2, 3
    tr = replay_greedy(seq, 2, ng, 3, 5)
    assert tr.output == seq[2:7]
    assert tr.stats.num_drafts == 2 and tr.stats.accepted_hist == [1, 0, 0, 1]  # a miss, then a full copy
    with pytest.raises(ValueError, match="too short"):
        replay_greedy(seq, 2, ng, 3, 8)  # 8 new tokens + k = 3 need 11 continuation tokens, there are 8


# ---------------------------------------------------------------------------------------------------------
# rejection sampling


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at significance 1e-3 (scipy.stats.chi2.ppf(0.999, df)); fixed seeds make the
# tests deterministic, the margin makes them robust to a change of seed.
_CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47}


def _chi2_quantile_999(df: int) -> float:
    """The 0.999 quantile of chi-square(df), Wilson-Hilferty (within 1% for df >= 5)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_sampled_emits_the_target_distribution(one_hot: bool):
    """Whatever q proposes, each emitted token is distributed as p (position-wise, p fixed per position)."""
    from eagle3lab.speculate import verify_sampled

    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.4, 0.1, 0.1]])
    first, second = torch.zeros(4), torch.zeros(4)
    n_acc = 0
    for _ in range(20000):
        if one_hot:  # greedy drafts: q is one-hot on the draft (vLLM's EAGLE proposer)
            drafts = [1, 0]
            qq = torch.zeros(2, 4)
            qq[0, 1] = qq[1, 0] = 1
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            qq = q
        a, extra = verify_sampled(drafts, p, qq, g)
        emitted = drafts[:a] + [extra]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        n_acc += a
    assert 0 < n_acc < 40000
    assert _chi2(first, p[0]) < _CHI2_999[3]
    assert _chi2(second, p[1]) < _CHI2_999[3]


def test_sampled_decoding_matches_target_sampling():
    """End to end on a tiny target: the second generated token (drafted, verified by rejection sampling) has
    the target's own two-step marginal sum_x p(x | prompt) p(y | prompt, x). The drafter proposes the
    target's argmax (often accepted, often not), so a wrong acceptance rule or residual shows."""
    from eagle3lab.speculate import speculative_decode

    model, cfg = tiny_target(4)
    drafter = drafter_for(model, cfg, 2, lm_head=True)

    def argmax_proposer(token_ids, aux, num_tokens):
        seq = token_ids.tolist()
        with torch.no_grad():
            for _ in range(num_tokens):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[-num_tokens:]

    drafter.propose = argmax_proposer
    prompt = [7, 8, 9]
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        seqs = torch.tensor([prompt + [x] for x in range(cfg.vocab_size)])
        p2 = torch.softmax(model(input_ids=seqs).logits[:, -1], -1)
    marginal = (p1[:, None] * p2).sum(0)
    g = torch.Generator().manual_seed(0)
    n = 800
    counts = torch.zeros(cfg.vocab_size)
    accepted = 0
    for _ in range(n):
        tr = speculative_decode(model, drafter, prompt, 1, 2, None, temperature=1.0, generator=g)
        counts[tr.output[1]] += 1
        accepted += tr.stats.num_accepted_tokens
    assert 0.1 * n < accepted < 0.9 * n, "the test must see accepted and rejected drafts"
    # Pool the tokens of small expected count into one bin (chi-square needs expected counts >= 5).
    big = marginal * n >= 5
    pooled_c = torch.cat([counts[big], counts[~big].sum()[None]])
    pooled_p = torch.cat([marginal[big], marginal[~big].sum()[None]])
    df = int(big.sum())  # bins - 1
    assert _chi2(pooled_c, pooled_p) < _chi2_quantile_999(df)


def test_greedy_draft_sampling_at_temperature_uses_one_hot_q(monkeypatch):
    """Greedy drafts at T > 0 are verified against a one-hot q on each draft: every q the verifier gets is
    one-hot on its draft, so acceptance is p(x) and a rejected draft is never the token drawn in its place
    (the residual max(0, p - q) is 0 at x). Seen on the verifier's own inputs, then the outputs."""
    from eagle3lab import speculate as SP
    from eagle3lab.speculate import speculative_decode

    model, cfg = tiny_target(2)
    drafter = drafter_for(model, cfg, 1, lm_head=True)
    seen: list[tuple[list[int], torch.Tensor, int, int]] = []
    verify = SP.verify_sampled

    def spy(drafts, p, q, generator=None):
        a, extra = verify(drafts, p, q, generator)
        seen.append((list(drafts), q.clone(), a, extra))
        return a, extra

    monkeypatch.setattr(SP, "verify_sampled", spy)
    for seed in range(6):
        speculative_decode(model, drafter, [1, 2, 3], 3, 8, None, temperature=1.0,
                           generator=torch.Generator().manual_seed(seed))
    assert seen and any(a < 3 for _, _, a, _ in seen), "the test must see rejections"
    for drafts, q, a, extra in seen:
        assert q.shape[0] == 3 and torch.equal(q.sum(-1), torch.ones(3))
        assert all(q[i, x] == 1.0 for i, x in enumerate(drafts)), "q must be one-hot on each draft"
        if a < 3:
            assert extra != drafts[a], "a rejected draft cannot be the token resampled in its place"
    monkeypatch.undo()

    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = speculative_decode(model, drafter, [1, 2, 3], 3, 8, None, temperature=1.0, generator=g1)
    b = speculative_decode(model, drafter, [1, 2, 3], 3, 8, None, temperature=1.0, generator=g2)
    assert a.output == b.output and a.stats == b.stats  # seeded: reproducible
    assert len(a.output) == 8 and all(len(r.drafted) == 3 for r in a.rounds)
    s = speculative_decode(model, drafter, [1, 2, 3], 3, 8, None, temperature=1.0,
                           generator=torch.Generator().manual_seed(3), draft_sampling="sample")
    assert len(s.output) == 8
    with pytest.raises(ValueError, match="draft_sampling"):
        speculative_decode(model, drafter, [1, 2, 3], 3, 8, None, temperature=1.0, draft_sampling="beam")


def test_mla_expand_memo_keeps_generation_identical():
    from eagle3lab.speculate import mla_expand_memo

    model, cfg = tiny_target(5)
    prompts = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = model.generate(input_ids=prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)
        with mla_expand_memo(model):
            assert sum("expand_kv" in vars(m) for m in model.modules()) == cfg.num_hidden_layers  # patched
            got = model.generate(input_ids=prompts, max_new_tokens=12, do_sample=False, pad_token_id=0)
            again = model.generate(input_ids=prompts[:1], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ref, got) and torch.equal(ref[:1], again)  # a new call (other batch) starts afresh
    assert all("expand_kv" not in vars(m) for m in model.modules())  # the class method is back


def test_mla_expand_memo_blocks_nest():
    """The reference engine memoises its own generate calls; a caller's block around them must survive."""
    from eagle3lab import target as T
    from eagle3lab.speculate import mla_expand_memo

    model = T.build_model(T.make_config(T.tiny_spec(), _Tok()), seed=0)
    mods = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    with mla_expand_memo(model):
        with mla_expand_memo(model):
            pass
        assert mods and all("expand_kv" in m.__dict__ for m in mods)
    assert not any("expand_kv" in m.__dict__ for m in mods)


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 300
