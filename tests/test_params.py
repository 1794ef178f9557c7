"""Parameter profiles: the shipped ones validate, bad ones fail with one clear message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3lab import params

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(data))
    return f


def test_shipped_cpu_profiles_validate():
    for name in ("embedded.yaml", "embedded-gpu.yaml"):
        p = params.load(ROOT / "params" / name)
        assert p.target.source == "embedded"
        assert len(set(p.resolved_aux_layer_ids())) == len(p.resolved_aux_layer_ids())


def test_kimi_profile_needs_the_users_checkpoint(tmp_path):
    with pytest.raises(params.ParamsError) as e:
        params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", ["target.path=/nonexistent/Kimi-K2.5"])
    assert e.value.field == "target.path" and "does not exist" in e.value.reason
    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 61}}))
    p = params.load(ROOT / "params" / "kimi-k2.5-8gpu.yaml", [f"target.path={ckpt}"])
    assert p.target.trust_remote_code is True
    assert p.engine.tensor_parallel_size == 8
    assert p.target_num_layers() == 61
    assert p.resolved_aux_layer_ids() == [2, 30, 58]


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


def test_cli_validate_exit_codes(tmp_path):
    bad = _write(tmp_path, {"profile": "x", "train": {"epochs": 0}})
    r = subprocess.run([sys.executable, "-m", "eagle3lab", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{bad}: train.epochs:" in r.stderr and r.stderr.count("\n") == 1
    ok = subprocess.run([sys.executable, "-m", "eagle3lab", "validate", str(ROOT / "params" / "embedded.yaml")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["profile"] == "embedded"
