"""eagle3lab.diagnose against the installed vLLM (run in both venvs: 0.26.0 native, 0.17.0 refuses).

Resolving the model classes is the slow part (vLLM's registry import), so each architecture is
diagnosed once per module and the tests read the stored results.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

pytest.importorskip("vllm", reason="tests/vllm need an installed vLLM (0.26.0 in .venv, 0.17.0 in .venvs)")

from eagle3lab import diagnose as dg  # noqa: E402
from eagle3lab import vllm_compat  # noqa: E402
from eagle3lab.errors import InputError  # noqa: E402

VERSION = tuple(int(p) for p in version("vllm").split(".")[:2])
NATIVE = VERSION >= (0, 18)
only_legacy = pytest.mark.skipif(NATIVE, reason="vLLM >= 0.18 has no model-type gate for eagle3")
only_native = pytest.mark.skipif(not NATIVE, reason="vLLM <= 0.17 has a model-type gate for eagle3")
ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")


def _write(path, cfg):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return _write(
        tmp_path_factory.mktemp("kimi"),
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "hidden_size": 7168,
                "vocab_size": 163840,
            },
        },
    )


@pytest.fixture(scope="module")
def by_arch():
    return {a: dg.diagnose(a) for a in ARCHS}


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return dg.diagnose(kimi_dir)


def test_protocol_members_read_from_the_installed_protocol():
    members = dg.eagle3_protocol_members()
    assert "set_aux_hidden_state_layers" in members and "supports_eagle3" in members
    # 0.26 renamed the getter; which name is present tells the releases apart.
    if NATIVE and VERSION >= (0, 26):
        assert "get_eagle3_default_aux_hidden_state_layers" in members
        assert "get_eagle3_aux_hidden_state_layers" not in members
    if not NATIVE:
        assert "get_eagle3_aux_hidden_state_layers" in members
        assert "get_eagle3_default_aux_hidden_state_layers" not in members
    assert not any(m.startswith("__") for m in members)


@pytest.mark.parametrize("arch", ARCHS)
def test_verdict_per_version(by_arch, arch):
    d = by_arch[arch]
    assert d.resolved and d.family
    assert d.levels[0].class_name == arch
    assert d.levels[0].file and d.levels[0].file.endswith(".py") and d.levels[0].line > 0
    if NATIVE:
        assert d.verdict == "native", d.reasons
        assert d.levels[0].supports_eagle3 and not d.levels[0].interface.members_missing
        assert d.plan == []
    else:
        assert d.verdict == "patchable", d.reasons
        top = d.levels[0].interface
        assert not top.supports_eagle3
        assert "set_aux_hidden_state_layers" in top.members_missing
        assert "get_eagle3_aux_hidden_state_layers" in top.members_missing
        kinds = {s.kind for s in d.plan}
        assert kinds == {"add_interface", "replace_forward", "admit_model_type"}
        # DeepseekV3 gets its members through its base, not on its own.
        targets = {s.target for s in d.plan if s.kind == "add_interface"}
        assert "DeepseekV2ForCausalLM" in targets and "DeepseekV3ForCausalLM" not in targets
    # The chain ends at the model that runs the layers, whose forward collects aux states only when native.
    inner = d.levels[-1]
    assert inner.class_name == "DeepseekV2Model" and inner.runs_layers
    assert inner.forward_collects_aux is NATIVE
    assert d.to_dict()["verdict"] == d.verdict
    json.dumps(d.to_dict())


def test_kimi_chain_follows_the_language_model(by_arch):
    lv = by_arch["KimiK25ForConditionalGeneration"].levels
    assert [x.class_name for x in lv] == [
        "KimiK25ForConditionalGeneration",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Model",
    ]
    assert [x.attribute for x in lv] == [None, "language_model", "model"]
    assert "SupportsMultiModal" in lv[0].interfaces
    assert ("SupportsEagle3" in lv[0].interfaces) is NATIVE
    # 01's member table: a row per Protocol member, a column per level
    rows = by_arch["KimiK25ForConditionalGeneration"].member_rows()
    assert [r["member"] for r in rows] == dg.eagle3_protocol_members()
    assert all(list(r)[1:] == [x.class_name for x in lv] for r in rows)
    wrapper = {r["member"]: r["KimiK25ForConditionalGeneration"] for r in rows}
    assert wrapper["supports_eagle3"] == ("yes" if NATIVE else "MISSING")


def test_raise_site_found_and_quoted(by_arch):
    sites = by_arch["DeepseekV3ForCausalLM"].raise_sites
    assert sites, "the refusal must be found in the installed vLLM"
    first = sites[0]
    assert first.exact and first.file.endswith("gpu_model_runner.py") and first.line > 0
    assert "does not support EAGLE3 interface but" in first.text and "aux_hidden_state_outputs" in first.text
    # The quoted line really is at that line of the installed file.
    src = (dg.vllm_package_dir().parent / first.file).read_text().splitlines()
    assert "raise" in src[first.line - 1]


@only_native
def test_no_front_end_gate_when_native(kimi):
    assert kimi.gates == [] and kimi.verdict == "native"
    assert vllm_compat.frontend_gates() == ()


@only_legacy
def test_front_end_gate(kimi, by_arch):
    gates = kimi.gates
    assert len(gates) == 1
    g = gates[0]
    assert "llama" in g.allowed and "qwen" in g.allowed
    assert g.config_attr == "hf_text_config"
    assert g.model_type == "deepseek_v3" and g.passes is False
    assert g.by_model_type == {"kimi_k25": False, "deepseek_v3": False}
    assert kimi.verdict == "patchable"
    assert any(s.kind == "admit_model_type" and "deepseek_v3" in s.detail for s in kimi.plan)
    # From a bare name, the model_type comes from transformers' mapping.
    v3 = by_arch["DeepseekV3ForCausalLM"]
    assert v3.gates[0].model_type == "deepseek_v3" and v3.gates[0].passes is False


def test_config_input_aux_ids(kimi):
    assert kimi.info.architecture == "KimiK25ForConditionalGeneration"
    assert kimi.info.model_type == "kimi_k25" and kimi.info.text_model_type == "deepseek_v3"
    assert kimi.info.num_hidden_layers == 61
    assert kimi.aux.ids == [2, 30, 58] and kimi.aux.source == "default rule" and kimi.aux.problems == []


def test_aux_ids_from_a_drafter_config(tmp_path):
    # The rules are tests/test_aux_layers.py's; here: where the ids come from, and that problems are reported.
    small = dg.resolve_aux_ids(6)
    assert small.ids == [2, 3, 3] and [p.code for p in small.problems] == ["AUX_DUPLICATE"]
    drafter = tmp_path / "d.json"
    drafter.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    a = dg.resolve_aux_ids(61, drafter)
    assert a.ids == [1, 29, 57] and a.source == "drafter config (eagle_config)"


def test_unknown_architecture_is_unsupported():
    d = dg.diagnose("NoSuchModelForCausalLM")
    assert d.verdict == "unsupported" and not d.resolved
    assert "not in vLLM" in d.reasons[0] and "NoSuchModelForCausalLM" in d.reasons[0]
    assert "UNSUPPORTED" in dg.format_diagnosis(d)


def test_not_patchable_model_is_unsupported(registry_rows):
    # A text model that is neither native nor patchable by the plan, picked from the installed registry.
    rows = [r for r in registry_rows if r.kind == "text" and r.status == "not patchable"]
    assert rows
    d = dg.diagnose(rows[0].architecture)
    assert d.resolved and not d.family and d.verdict == "unsupported"
    assert any(r.startswith("our patch does not apply: ") and rows[0].reason in r for r in d.reasons)
    assert d.plan == []


def test_bad_input_errors(tmp_path):
    with pytest.raises(InputError, match="config not found"):
        dg.diagnose(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(InputError, match="architectures"):
        dg.diagnose(tmp_path)


def test_cli_exit_codes(tmp_path):
    """2 for a path that is not a model (bad input), never for a failure of the work."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "eagle3lab", "diagnose", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config not found" in r.stderr and r.stderr.count("error:") == 1


def test_model_classes_load_one_way():
    assert vllm_compat.load_model_class("DeepseekV3ForCausalLM").__name__ == "DeepseekV3ForCausalLM"
    with pytest.raises(ValueError, match="not in vLLM"):
        vllm_compat.load_model_class("NoSuchModelForCausalLM")
    assert vllm_compat.try_load_model_class("NoSuchModelForCausalLM") is None


def test_format_mentions_the_essentials(by_arch, kimi):
    text = dg.format_diagnosis(kimi)
    assert "KimiK25ForConditionalGeneration" in text and "DeepseekV2Model" in text
    assert "gpu_model_runner.py" in text and "[2, 30, 58]" in text
    assert ("patch plan" in text) is (not NATIVE)


def test_registry_table_matches_supports_eagle3(registry_rows):
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    rows = {r.architecture: r for r in registry_rows}
    assert len(rows) > 100
    for arch in (*ARCHS, "LlamaForCausalLM", "Qwen2ForCausalLM"):
        cls = ModelRegistry._try_load_model_cls(arch)
        assert rows[arch].native_eagle3 is bool(supports_eagle3(cls)), arch
    for arch in ARCHS:  # native from 0.18, patchable before
        assert rows[arch].status == ("native" if NATIVE else "patchable"), (arch, rows[arch].reason)
    assert rows["KimiK25ForConditionalGeneration"].kind == "multimodal"
    assert rows["LlamaForCausalLM"].status == "native"
    counts = dg.registry_counts(list(rows.values()))[-1]
    assert counts.kind == "all" and counts.architectures == len(rows)
    assert counts.native + counts.patchable + counts.not_patchable + counts.not_loadable == len(rows)
    grouped = dg.reason_counts(list(rows.values()))
    assert sum(g["architectures"] for g in grouped) == counts.not_patchable + counts.not_loadable
    errors = dg.registry.import_error_counts(list(rows.values()))
    assert sum(g["architectures"] for g in errors) == counts.not_loadable


def test_import_error_counts_group_not_loadable_rows():
    from eagle3lab.diagnose.registry import NOT_LOADABLE, RegistryRow, import_error_counts

    def row(arch, status, reason):
        return RegistryRow(arch, "multimodal", "m", arch, status, reason)

    tv = "ModuleNotFoundError: No module named 'torchvision'"
    rows = [
        *(row(f"Vision{i}ForConditionalGeneration", NOT_LOADABLE, f"architecture 'Vision{i}': vLLM 0.26.0 lists it but "
              f"its class failed to import here: importing vllm.model_executor.models.v{i}.V{i} raised {tv}")
          for i in range(5)),
        row("Odd", NOT_LOADABLE, "architecture 'Odd': vLLM 0.26.0 cannot load its class (RuntimeError: no kernel)"),
        row("Half", NOT_LOADABLE, "architecture 'Half': vLLM 0.26.0 lists it but its class failed to import here: "
            "unknown (the class imports)"),
        row("LlamaForCausalLM", "native", "LlamaForCausalLM supports EAGLE-3 as installed"),
    ]
    got = import_error_counts(rows)
    assert [(g["import error"], g["architectures"]) for g in got] == [
        (tv, 5), ("RuntimeError: no kernel", 1), ("unknown (the class imports)", 1)]
    assert got[0]["examples"].endswith(" ...") and got[0]["examples"].count(",") == 3
    assert sum(g["architectures"] for g in got) == dg.registry_counts(rows)[-1].not_loadable


def test_a_class_that_fails_to_import_is_named_by_the_error_vllm_logged(monkeypatch):
    # LongcatFlashNgram on 0.26 without llguidance: the registry's first import fails half-way and is only logged,
    # and a second import of the module succeeds, so re-importing cannot tell why. The logged error must be named.
    import logging

    class Registry:
        models = {"Half": type("Entry", (), {"module_name": "json", "class_name": "JSONDecoder"})()}

        def get_supported_archs(self):
            return ["Half"]

        def _try_load_model_cls(self, arch):
            try:
                raise ModuleNotFoundError("No module named 'llguidance'")
            except ModuleNotFoundError:
                logging.getLogger("vllm.model_executor.models.registry").exception("Error in loading %s", arch)
            return None

    monkeypatch.setattr(vllm_compat, "model_registry", Registry)
    cls, why = vllm_compat._load_outcome.__wrapped__("Half")
    assert cls is None
    assert why.endswith("failed to import here: ModuleNotFoundError: No module named 'llguidance'"), why
    # nothing logged: the module is imported again, and here it imports, which is said as such
    monkeypatch.setattr(Registry, "_try_load_model_cls", lambda self, arch: None)
    assert vllm_compat._load_outcome.__wrapped__("Half")[1].endswith("unknown (the class imports)")
    assert not any(type(h).__name__ == "_LoggedErrors"
                   for h in logging.getLogger("vllm.model_executor.models.registry").handlers)
