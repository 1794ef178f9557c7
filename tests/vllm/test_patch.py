"""eagle3lab.patch (and its plugin and --check) against the installed vLLM (run in both venvs: 0.26.0
native, 0.17.0 legacy).

Resolving the model classes costs ~15 s, so one module fixture holds them; every test starts and ends
with revert() so no state leaks between tests. A case that exists in one release only is skipped, with
the reason, in the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="tests/vllm need an installed vLLM (0.26.0 in .venv, 0.17.0 in .venvs)")
torch = pytest.importorskip("torch")

from eagle3lab import patch, patch_check, plugin, vllm_compat  # noqa: E402

VERSION = vllm_compat.version_tuple()
NATIVE = VERSION >= (0, 18)
only_legacy = pytest.mark.skipif(NATIVE, reason="vLLM >= 0.18 has no model-type gate and native EAGLE-3")
only_native = pytest.mark.skipif(not NATIVE, reason="vLLM <= 0.17 has no native EAGLE-3 to remove or force over")
REFUSAL = "Model does not support EAGLE3 interface"


@pytest.fixture(scope="module")
def classes():
    patch.revert()
    c = patch._classes()
    yield c
    patch.revert()


@pytest.fixture
def c(classes):
    patch.revert()
    yield classes
    patch.revert()


def _sup(x) -> bool:
    from vllm.model_executor.models.interfaces import supports_eagle3

    return bool(supports_eagle3(x))


def _to_legacy() -> None:
    """The 0.15-0.17 state: as installed on 0.17, simulated on >= 0.18."""
    if NATIVE:
        rep = patch.simulate_legacy()
        assert not rep.noop and rep.actions


def _snapshot(c) -> dict:
    names = (*patch._EAGLE3_ONLY, "forward", "aux_hidden_state_layers")
    snap = {n: (cls.__bases__, {k: cls.__dict__.get(k) for k in names}) for n, cls in c.items()}
    snap["gates"] = [vllm_compat.gate_function(g).__code__ for g in vllm_compat.frontend_gates()]
    return snap


def _bare(cls, **attrs):
    # An instance without running vLLM's __init__ (which needs a GPU config): enough for the interface.
    inst = object.__new__(cls)
    inst.__dict__.update(attrs)
    return inst


def test_installed_state(c):
    members = patch.protocol_members()
    assert {"supports_eagle3", "set_aux_hidden_state_layers"} <= set(members)
    getter = "get_eagle3_default_aux_hidden_state_layers" if NATIVE else "get_eagle3_aux_hidden_state_layers"
    assert getter in members
    assert patch.native_support() is NATIVE
    for arch in patch.ARCHES:
        assert _sup(c[arch]) is NATIVE, arch
        assert (patch.refusal_for(c[arch]) is None) is NATIVE


def test_legacy_refused_then_apply_fixes(c):
    _to_legacy()
    for arch in patch.ARCHES:
        assert not _sup(c[arch]), arch
        assert REFUSAL in patch.refusal_for(c[arch])
    rep = patch.apply()
    assert not rep.noop and rep.actions
    assert [r["supports_eagle3"] for r in rep.before] == [False] * 3
    assert [r["supports_eagle3"] for r in rep.after] == [True] * 3
    sup = sys.modules["vllm.model_executor.models.interfaces"].SupportsEagle3
    for arch in patch.ARCHES:
        cls = c[arch]
        assert _sup(cls) and patch.refusal_for(cls) is None, arch
        assert sup in cls.__mro__ and cls.__mro__.count(sup) == 1
        assert isinstance(_bare(cls), sup)  # instances, as the model runner checks them
        row = patch.interface_matrix([arch])[0]
        assert row["members_missing"] == [] and row["nominal"], row
    assert c["DeepseekV2Model"].forward.__eagle3lab__


def test_members_behave(c):
    _to_legacy()
    patch.apply()
    getter = next(g for g in patch._GETTERS if g in patch.protocol_members())
    inner = SimpleNamespace()
    lm = _bare(c["DeepseekV3ForCausalLM"], config=SimpleNamespace(num_hidden_layers=61), model=inner)
    assert getattr(lm, getter)() == (2, 30, 58)
    lm.set_aux_hidden_state_layers((58, 2, 30))
    assert inner.aux_hidden_state_layers == (2, 30, 58)
    with pytest.raises(ValueError, match="id 0"):
        lm.set_aux_hidden_state_layers((0, 30))
    kimi = _bare(c["KimiK25ForConditionalGeneration"], language_model=lm)
    assert getattr(kimi, getter)() == (2, 30, 58)
    kimi.set_aux_hidden_state_layers((3, 61))
    assert inner.aux_hidden_state_layers == (3, 61)


def test_idempotent_and_revert_restores(c):
    original = _snapshot(c)
    _to_legacy()
    first = patch.apply()
    state = patch.applied()
    bases = {n: cls.__bases__ for n, cls in c.items()}
    second = patch.apply()
    assert second.noop and "already applied" in second.reason
    assert patch.applied() == state and first.actions
    assert {n: cls.__bases__ for n, cls in c.items()} == bases
    patch.revert()
    assert patch.applied() == {}
    assert _snapshot(c) == original
    for arch in patch.ARCHES:
        assert _sup(c[arch]) is NATIVE


@only_native
def test_no_frontend_gate_on_native_releases(c):
    assert vllm_compat.frontend_gates() == ()
    assert patch.frontend_admits("deepseek_v3") and patch.frontend_admits("kimi_k25")


@only_legacy
def test_frontend_gate(c):
    from transformers import DeepseekV3Config
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config

    (found,) = vllm_compat.frontend_gates()  # located once, in the source, by structure
    gate = vllm_compat.gate_function(found)
    assert "llama" in found.allowed and found.config_attr == "hf_text_config"
    # The compiled constant the patch extends is the list read from the source, exactly.
    assert gate.__code__.co_consts[vllm_compat.gate_constant_index(found)] == found.allowed
    # The same function object pydantic runs after validating SpeculativeConfig; ``self`` carries
    # what the validator reads, with real hf configs as the front end would hold them.
    hf_configs = {"deepseek_v3": DeepseekV3Config(), "kimi_k25": KimiK25Config()}

    def validate(hf):
        fake = SimpleNamespace(
            tensor_parallel_size=None, num_speculative_tokens=3, draft_model_config=None, method="eagle3",
            target_model_config=SimpleNamespace(hf_text_config=get_hf_text_config(hf)),
            verify_equal_vocab_size_if_draft_model=lambda: None,  # the check after the gate
        )
        return gate(fake)

    for name, hf in hf_configs.items():
        with pytest.raises(ValueError, match="eagle3 is only supported for"):
            validate(hf)
        assert not patch.frontend_admits(get_hf_text_config(hf).model_type), name
    patch.apply()
    for name, hf in hf_configs.items():
        assert validate(hf) is not None, name
    assert all(patch.frontend_admits(t) for t in patch.GATE_MODEL_TYPES)
    patch.revert()
    with pytest.raises(ValueError, match="eagle3 is only supported for"):
        validate(hf_configs["deepseek_v3"])
    assert not patch.frontend_admits("deepseek_v3")


@pytest.mark.slow
@pytest.mark.skipif(NATIVE, reason="the model-type gate exists in vLLM <= 0.17 only")
def test_frontend_gate_real_speculative_config(c, tmp_path, monkeypatch):
    """Build SpeculativeConfig as the front end does (ModelConfig from a config.json folder)."""
    from transformers import DeepseekV3Config, LlamaConfig
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, draft = tmp_path / "target", tmp_path / "draft"
    DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=256, architectures=["DeepseekV3ForCausalLM"],
    ).save_pretrained(target)
    LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, architectures=["LlamaForCausalLMEagle3"],
    ).save_pretrained(draft)
    mc = ModelConfig(model=str(target), skip_tokenizer_init=True)

    def build():
        return SpeculativeConfig(
            method="eagle3", model=str(draft), num_speculative_tokens=2, target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )

    with pytest.raises(ValueError, match="eagle3 is only supported for"):
        build()
    patch.apply()
    assert build().method == "eagle3"


@only_legacy
def test_simulation_is_a_noop_on_legacy_releases(c):
    rep = patch.simulate_legacy()
    assert rep.noop and "nothing to simulate" in rep.reason and patch.applied() == {}


@only_native
def test_native_noop_unless_forced(c):
    native_forward = c["DeepseekV2Model"].forward
    rep = patch.apply()
    assert rep.noop and "natively" in rep.reason and patch.applied() == {}
    rep = patch.apply(force=True)
    assert not rep.noop and c["DeepseekV2Model"].forward.__eagle3lab__
    patch.revert()
    assert c["DeepseekV2Model"].forward is native_forward


def test_plugin_bad_value_never_raises(c, monkeypatch, caplog):
    for raw in ("{not json", '{"apply": "yes"}', '{"aply": true}', "[1]"):
        monkeypatch.setenv(plugin.ENV_VAR, raw)
        plugin.vllm_plugin()  # must not raise into vLLM
        assert patch.applied() == {}
    assert "not applied" in caplog.text
    monkeypatch.delenv(plugin.ENV_VAR)
    plugin.vllm_plugin()
    assert patch.applied() == {}


def test_plugin_env(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = plugin.plugin_env(True, False, True)
    assert set(env) == {plugin.ENV_VAR}
    # parsed, the list of architectures is always there (empty: the DeepSeek/Kimi path)
    assert plugin.parse_plugin_env(env[plugin.ENV_VAR]) == {
        "apply": True, "force": False, "legacy_simulation": True, "architectures": []}
    glm = plugin.plugin_env(True, architectures=["Glm4MoeForCausalLM"])[plugin.ENV_VAR]
    assert plugin.parse_plugin_env(glm)["architectures"] == ["Glm4MoeForCausalLM"]
    with pytest.raises(ValueError, match="architectures must be a list"):
        plugin.parse_plugin_env('{"apply": true, "architectures": "Glm4MoeForCausalLM"}')
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert plugin.plugin_env(True)["VLLM_PLUGINS"] == "other,eagle3lab"
    monkeypatch.setenv("VLLM_PLUGINS", "eagle3lab,other")
    assert "VLLM_PLUGINS" not in plugin.plugin_env(True)


_PLUGIN_SCRIPT = textwrap.dedent(
    """
    import json
    from importlib.metadata import entry_points
    eps = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "eagle3lab"]
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    from eagle3lab import patch
    arches = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]
    print("RESULT" + json.dumps({
        "entry_points": eps,
        "supported": {a: bool(supports_eagle3(ModelRegistry._try_load_model_cls(a))) for a in arches},
        "groups": sorted(patch.applied()),
    }))
    """
)


def test_plugin_through_vllm_loader():
    env = {**os.environ, **plugin.plugin_env(apply=True, force=False, legacy_simulation=True)}
    env["VLLM_PLUGINS"] = "eagle3lab"
    proc = subprocess.run(
        [sys.executable, "-c", _PLUGIN_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    out = json.loads(line[len("RESULT"):])
    assert out["entry_points"] == ["eagle3lab.plugin:vllm_plugin"]
    assert all(out["supported"].values()), out
    # On >= 0.18 the simulation ran first, then the patch; on 0.17 only the patch had work to do.
    assert out["groups"] == (["legacy_simulation", "patch"] if NATIVE else ["patch"])


# ---- our DeepseekV2Model.forward against the installed release's own, on fake layers -----------------


class _Layer:
    use_sequence_parallel_moe = False

    def __init__(self, i: int) -> None:
        self.w = 0.5 + 0.1 * i

    def __call__(self, positions, hidden, residual, llama_4_scaling=None):
        stream = hidden if residual is None else hidden + residual
        return torch.tanh(stream * self.w), stream


def _fake_model(n_layers: int, aux=(), start=0, end=None):
    emb = torch.randn(32, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return SimpleNamespace(
        config=SimpleNamespace(),
        layers=[_Layer(i) for i in range(n_layers)],
        start_layer=start,
        end_layer=n_layers if end is None else end,
        aux_hidden_state_layers=tuple(aux),
        hidden_size=8,
        embed_input_ids=lambda ids: emb[ids],
        norm=lambda h, r: ((h + r) * 2.0, h + r),
    )


def _pp(first: bool, last: bool):
    return lambda: SimpleNamespace(is_first_rank=first, is_last_rank=last)


def _flat(x) -> list:
    if hasattr(x, "tensors"):  # IntermediateTensors (not the last pipeline rank)
        return list(x.tensors.values())
    return [x[0], *x[1]] if isinstance(x, tuple) else [x]


@pytest.mark.parametrize("rank", ["only", "first", "last"])
def test_forward_matches_installed(c, monkeypatch, rank):
    mod = sys.modules[c["DeepseekV2Model"].__module__]
    native = c["DeepseekV2Model"].forward
    first, last = rank in ("only", "first"), rank in ("only", "last")
    monkeypatch.setattr(mod, "get_pp_group", _pp(first, last))
    ours = patch._make_inner_forward(mod, native)
    ids, pos = torch.tensor([1, 5, 7]), torch.arange(3)
    inter = None
    if not first:
        g = torch.Generator().manual_seed(1)
        inter = {"hidden_states": torch.randn(3, 8, generator=g, dtype=torch.float64),
                 "residual": torch.randn(3, 8, generator=g, dtype=torch.float64)}
    start, end = (3, 6) if rank == "last" else (0, 3 if rank == "first" else 6)
    aux = (2, 4, 6) if NATIVE else ()  # 0.17's own forward collects nothing
    want = native(_fake_model(6, aux, start, end), ids, pos, inter)
    got = ours(_fake_model(6, aux, start, end), ids, pos, inter)
    assert type(got) is type(want)
    for a, b in zip(_flat(got), _flat(want), strict=True):
        torch.testing.assert_close(a, b)


def test_forward_collects_like_026(c, monkeypatch):
    # Hand-check of ours on any release: hidden + residual at the input of layers 2 and 4, final state at 6.
    mod = sys.modules[c["DeepseekV2Model"].__module__]
    monkeypatch.setattr(mod, "get_pp_group", _pp(True, True))
    ours = patch._make_inner_forward(mod, c["DeepseekV2Model"].forward)
    m = _fake_model(6, (6, 2, 4))
    out, aux = ours(m, torch.tensor([3, 4]), torch.arange(2), None)
    h, r, streams = m.embed_input_ids(torch.tensor([3, 4])), None, {}
    for k, layer in enumerate(m.layers):
        if r is not None:
            streams[k] = h + r
        h, r = layer(None, h, r)
    streams[6] = h + r
    assert len(aux) == 3
    for got, k in zip(aux, (2, 4, 6), strict=True):
        torch.testing.assert_close(got, streams[k])
    torch.testing.assert_close(out, streams[6] * 2.0)
    embeds = m.embed_input_ids(torch.tensor([3, 4]))
    out2, _ = ours(m, None, torch.arange(2), None, inputs_embeds=embeds)
    torch.testing.assert_close(out2, out)


def test_check_for_the_cli(c):
    d = patch_check.check("KimiK25ForConditionalGeneration", apply=True, legacy_simulation=NATIVE)
    assert d["before"]["supports_eagle3"] is False and REFUSAL in d["refusal_before"]
    assert d["after"]["supports_eagle3"] is True and d["refusal_after"] is None and d["ok"]
    text = patch_check.format_check(d)
    assert "KimiK25ForConditionalGeneration" in text and text.rstrip().endswith("OK")
    with pytest.raises(ValueError, match="NoSuchArch"):
        patch_check.check("NoSuchArch")


def test_cli_exit_codes(tmp_path):
    """2 for input the user got wrong (an architecture this vLLM lacks), 0 for a check that passes."""
    cmd = [sys.executable, "-m", "eagle3lab", "patch", "--check"]
    bad = subprocess.run([*cmd, "NoSuchArch"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "NoSuchArch" in bad.stderr, bad.stderr[-2000:]
    profile = tmp_path / "p.yaml"
    profile.write_text(f"profile: p\ndrafter: {{aux_layer_ids: [2, 4, 6]}}\n"
                       f"patch: {{apply: true, legacy_simulation: {str(NATIVE).lower()}}}\n")
    ok = subprocess.run([*cmd, "DeepseekV3ForCausalLM", "--params", str(profile), "--json"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["after"]["supports_eagle3"] is True


def test_cli_patch_check_outside_a_checkout(tmp_path):
    """A user's own folder has no params/embedded.yaml: patch --check applies the patch as the plugin does
    (apply, no simulation) instead of failing on the missing default profile (it exited 2 before)."""
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3LAB_ROOT"}
    res = subprocess.run([sys.executable, "-m", "eagle3lab", "patch", "--check", "DeepseekV3ForCausalLM", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    assert d["after"]["supports_eagle3"] is True and d["legacy_simulation"] is False
