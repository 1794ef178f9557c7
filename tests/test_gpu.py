"""GPU checks (skipped without CUDA): drafter training and the reference decoder on the device.

Run on the lent H200 with `python -m pytest -m gpu tests/test_gpu.py`; the output is committed under
benchmarks/gpu/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ttt_training_on_cuda_learns_and_resumes(tmp_path: Path):
    from eagle3lab.train import train_drafter
    from test_train import make_data, make_drafter

    kw = dict(ttt_steps=3, epochs=4, batch_size=4, lr=3e-3, warmup=2, checkpoint_every=3, seed=1,
              progress=False, device="cuda")
    data = make_data(12)
    a = make_drafter()
    ra = train_drafter(a, data, checkpoint_dir=tmp_path / "a", **kw)
    assert next(a.parameters()).is_cuda
    assert ra.losses[-1] < ra.losses[0]
    # The same training on the CPU follows the same curve: the device changes nothing but speed.
    cpu = train_drafter(make_drafter(), data, **{**kw, "device": "cpu", "checkpoint_every": 100})
    assert ra.losses == pytest.approx(cpu.losses, rel=1e-3, abs=1e-4)
    b = make_drafter()
    train_drafter(b, data, checkpoint_dir=tmp_path / "b", stop_after=5, **kw)
    b2 = make_drafter(seed=99)
    rb = train_drafter(b2, data, checkpoint_dir=tmp_path / "b", **kw)
    assert rb.resumed_from == 5 and rb.steps == ra.steps
    # CUDA kernels may reorder reductions: equal up to float noise rather than bit for bit.
    assert rb.losses == pytest.approx(ra.losses, rel=1e-4, abs=1e-5)


def test_speculative_decoding_on_cuda_equals_greedy():
    from eagle3lab.speculate import greedy_generate, speculative_generate
    from test_speculate import drafter_for, tiny_target

    model, cfg = tiny_target(3)
    model = model.cuda()
    drafter = drafter_for(model, cfg, seed=0, lm_head=True).cuda()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
        ref = greedy_generate(model, prompt, 16)
        out, st = speculative_generate(model, drafter, prompt, 3, 16, None)
        assert out == ref
        assert st.num_drafts > 0 and st.num_draft_tokens == 3 * st.num_drafts
