"""The pipeline's figures (eagle3lab.pipeline): every expected number below is worked out by hand in the test,
from a fake run whose figures are round, from the seed's reported figures, or from the committed GPU run."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from eagle3lab import pipeline
from eagle3lab.pipeline import KIMI_K25, SEED, Projection, SeedPipeline, Stage, TargetShape

ROOT = Path(__file__).resolve().parents[1]
H200_RUN = ROOT / "benchmarks" / "gpu" / "20261204-h200-c" / "workbook"

# A run of 10 samples, 1000 sample tokens (800 of them response), generated in 10 s, extracted at 500 tokens/s
# into 6,000,000 bytes, trained 20 steps of batch 2 (5 steps an epoch: 4 epochs) in 30 s.
METRICS = {
    "run": {"run": "fake"},
    "ok": True,
    "metrics": {
        "00_target": {"target.active_params": 100_000_000, "target.num_layers": 10},
        "03_engine": {
            "data.num_samples": 10,
            "data.tokens": 1000,
            "data.response_tokens": 800,
            "data.generate_seconds": 10.0,
            "data.generate_tokens_per_s": 80.0,
            "hidden.tokens_per_s": 500.0,
            "hidden.bytes": 6_000_000,
            "hidden.aux_layer_ids": [1, 5, 7],
        },
        "04_train_drafter": {"train.seconds": 30.0, "train.steps": 20},
    },
}
PARAMS = {
    "target": {"embedded": {"hidden_size": 1000, "num_hidden_layers": 10}},
    "engine": {"tensor_parallel_size": 1},
    "data": {"hidden_dtype": "bfloat16"},
    "train": {"epochs": 4, "batch_size": 2},
}
OURS = TargetShape(hidden_size=1000, num_layers=10, active_params=1e8, num_aux=3, bytes_per_value=2, gpus=1)


def fake_metrics() -> dict:
    return copy.deepcopy(METRICS)


def by_name(stages: list[Stage]) -> dict[str, Stage]:
    return {s.name: s for s in stages}


# ---------------------------------------------------------------------------------------------------------
# a run's stages


def test_stages_from_a_fake_run():
    s = by_name(pipeline.stages_from_metrics(fake_metrics(), PARAMS))
    assert list(s) == ["generate", "extract", "train"]
    # generate: 1000 sample tokens in 10 s -> 100 tokens/s (not the recorded 80: that one counts responses)
    assert (s["generate"].seconds, s["generate"].tokens, s["generate"].bytes) == (10.0, 1000.0, None)
    assert s["generate"].tokens_per_s == pytest.approx(100.0)
    # extract: 1000 tokens at 500 tokens/s -> 2 s; its bytes as recorded
    assert s["extract"].seconds == pytest.approx(2.0)
    assert s["extract"].tokens_per_s == pytest.approx(500.0)
    assert s["extract"].bytes == 6_000_000
    # train: 20 steps / 5 steps an epoch = 4 epochs -> 4000 token passes in 30 s
    assert s["train"].tokens == pytest.approx(4000.0)
    assert s["train"].seconds == 30.0
    assert s["train"].tokens_per_s == pytest.approx(4000 / 30)


def test_the_metrics_section_alone_gives_the_same_stages():
    whole = pipeline.stages_from_metrics(METRICS, PARAMS)
    assert pipeline.stages_from_metrics(METRICS["metrics"], PARAMS) == whole


def test_stage_metrics_are_flat_keys():
    stage = Stage("extract", 2.0, 1000.0, 500.0, 6e6)
    assert stage.metrics() == {"pipeline.extract.seconds": 2.0, "pipeline.extract.tokens": 1000.0,
                               "pipeline.extract.tokens_per_s": 500.0, "pipeline.extract.bytes": 6e6}
    assert stage.seconds_per_token == pytest.approx(0.002)


def test_missing_keys_give_none_not_an_error():
    stages = pipeline.stages_from_metrics({}, {})
    assert [s.name for s in stages] == ["generate", "extract", "train"]
    for s in stages:
        assert (s.seconds, s.tokens, s.tokens_per_s, s.bytes) == (None, None, None, None)

    m = fake_metrics()
    del m["metrics"]["03_engine"]["hidden.tokens_per_s"]
    del m["metrics"]["04_train_drafter"]["train.seconds"]
    s = by_name(pipeline.stages_from_metrics(m, PARAMS))
    assert s["extract"].seconds is None and s["extract"].tokens_per_s is None
    assert s["extract"].bytes == 6_000_000  # what is recorded stays
    assert s["train"].seconds is None and s["train"].tokens == pytest.approx(4000.0)
    assert s["generate"].seconds == 10.0


def test_a_skipped_generation_is_none_or_read_from_the_response_rate():
    m = fake_metrics()
    m["metrics"]["03_engine"]["data.generate_seconds"] = 0.0  # 03 records 0 s when the samples were there
    # 800 response tokens at 80 tokens/s -> 10 s
    assert by_name(pipeline.stages_from_metrics(m, PARAMS))["generate"].seconds == pytest.approx(10.0)
    del m["metrics"]["03_engine"]["data.generate_tokens_per_s"]
    assert by_name(pipeline.stages_from_metrics(m, PARAMS))["generate"].seconds is None


def test_a_nan_rate_and_a_recorded_extraction_time():
    m = fake_metrics()
    m["metrics"]["03_engine"]["hidden.tokens_per_s"] = float("nan")  # a rate over 0 s
    assert by_name(pipeline.stages_from_metrics(m, PARAMS))["extract"].seconds is None
    m["metrics"]["03_engine"]["hidden.seconds"] = 4.0
    ext = by_name(pipeline.stages_from_metrics(m, PARAMS))["extract"]
    assert ext.seconds == 4.0 and ext.tokens_per_s == pytest.approx(250.0)


def test_epochs_from_the_steps_else_from_the_params():
    m = fake_metrics()
    m["metrics"]["04_train_drafter"]["train.steps"] = 7  # max_steps cut it: 7 / 5 = 1.4 epochs
    assert pipeline.epochs_done(m, PARAMS) == pytest.approx(1.4)
    assert by_name(pipeline.stages_from_metrics(m, PARAMS))["train"].tokens == pytest.approx(1400.0)
    del m["metrics"]["04_train_drafter"]["train.steps"]
    assert pipeline.epochs_done(m, PARAMS) == 4.0
    assert pipeline.epochs_done(m, {}) is None


def test_shape_from_a_fake_run():
    assert pipeline.shape_from_metrics(fake_metrics(), PARAMS) == OURS
    with pytest.raises(ValueError, match="hidden_size, active_params"):
        pipeline.shape_from_metrics({"metrics": {}}, {"data": {"hidden_dtype": "float32"},
                                                      "drafter": {"aux_layer_ids": [1, 2]},
                                                      "target": {"embedded": {"num_hidden_layers": 4}}})


def test_make_stage_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="generate, extract, train"):
        pipeline.make_stage("serve", 1.0, 1.0)


# ---------------------------------------------------------------------------------------------------------
# shapes and the seed


def test_bytes_per_token_at_kimi_widths():
    assert KIMI_K25.bytes_per_token == 43_008  # 3 aux layers x 7168 x 2 bytes = 21,504 x 2
    assert OURS.bytes_per_token == 6000  # 3 x 1000 x 2


def test_the_seeds_derived_figures():
    # 828e9 B / 43,008 B a token = 19,252,232 tokens; / 10,000 samples = 1925 tokens a sample
    assert SEED.tokens == pytest.approx(19.25e6, rel=1e-3)
    assert SEED.tokens == pytest.approx(19_252_232, abs=1)
    assert SEED.tokens_per_sample == pytest.approx(1925.2, abs=0.1)
    # 19,252,232 / 3165 tokens/s = 6083 s, about 1.69 h
    assert SEED.extract_seconds == pytest.approx(6083, abs=1)
    assert SEED.extract_seconds / 3600 == pytest.approx(1.69, abs=0.005)
    # 5.3 h + 1.69 h + 2.6 h = 9.59 h = 34,523 s
    assert SEED.total_seconds == pytest.approx(34_523, abs=1)
    s = by_name(SEED.stages())
    assert s["generate"].seconds == pytest.approx(19_080)  # 5.3 x 3600
    assert s["extract"].bytes == 828e9 and s["extract"].tokens_per_s == 3165
    assert s["train"].tokens == pytest.approx(5 * 19_252_232, abs=5)  # 5 epochs
    assert s["train"].seconds == pytest.approx(9360)  # 2.6 x 3600


# ---------------------------------------------------------------------------------------------------------
# the projection


def fake_stages() -> list[Stage]:
    """generate 10 s, extract 2 s (6,000,000 B), train 30 s, over 1000 tokens (4000 token passes)."""
    return pipeline.stages_from_metrics(fake_metrics(), PARAMS)


def projected(to: TargetShape, samples: int = 10, tokens_per_sample: float = 100, epochs: int = 4):
    return by_name(pipeline.project(fake_stages(), OURS, to, samples, tokens_per_sample, epochs).stages)


def test_projecting_to_the_same_shape_and_workload_gives_the_run_back():
    p = projected(OURS)  # 10 x 100 = 1000 tokens, 4 epochs: the run itself
    assert p["generate"].seconds == pytest.approx(10.0)
    assert p["extract"].seconds == pytest.approx(2.0)
    assert p["extract"].bytes == pytest.approx(6_000_000)  # 1000 tokens x 6000 B
    assert p["train"].seconds == pytest.approx(30.0)


def test_doubled_active_parameters_double_generation_and_extraction():
    p = projected(TargetShape(1000, 10, 2e8, 3, 2, 1))
    assert p["generate"].seconds == pytest.approx(20.0)
    assert p["extract"].seconds == pytest.approx(4.0)
    assert p["train"].seconds == pytest.approx(30.0)  # the drafter's width is unchanged
    assert p["extract"].bytes == pytest.approx(6_000_000)


def test_twice_the_gpus_halve_them():
    p = projected(TargetShape(1000, 10, 1e8, 3, 2, 2))
    assert p["generate"].seconds == pytest.approx(5.0)
    assert p["extract"].seconds == pytest.approx(1.0)
    assert p["train"].seconds == pytest.approx(30.0)
    both = projected(TargetShape(1000, 10, 2e8, 3, 2, 2))
    assert both["generate"].seconds == pytest.approx(10.0)


def test_twice_the_width_quadruples_training_and_doubles_the_bytes():
    p = projected(TargetShape(2000, 10, 1e8, 3, 2, 1))
    assert p["train"].seconds == pytest.approx(120.0)  # 30 s x 2^2
    assert p["extract"].bytes == pytest.approx(12_000_000)  # 1000 x 3 x 2000 x 2
    assert p["generate"].seconds == pytest.approx(10.0)


def test_the_workload_scales_each_stage():
    p = projected(OURS, samples=20, epochs=2)  # 2000 tokens, 2 epochs: 4000 passes
    assert p["generate"].seconds == pytest.approx(20.0)
    assert p["extract"].seconds == pytest.approx(4.0)
    assert p["train"].tokens == pytest.approx(4000.0)
    assert p["train"].seconds == pytest.approx(30.0)


def test_projecting_the_fake_run_to_kimi():
    proj = pipeline.project(fake_stages(), OURS, KIMI_K25, 10_000, 2000, 5)
    p = by_name(proj.stages)
    # 20 M tokens at 0.01 s a token, x 320 (32e9 / 1e8) / 8 GPUs = x 40 -> 8,000,000 s
    assert p["generate"].seconds == pytest.approx(8_000_000)
    # 20 M tokens at 0.002 s, x 40 -> 1,600,000 s
    assert p["extract"].seconds == pytest.approx(1_600_000)
    # 20 M x 43,008 B = 860.16 GB
    assert p["extract"].bytes == pytest.approx(860.16e9)
    # 100 M passes at 30 / 4000 s, x (7.168)^2 = 51.380224 -> 38,535,168 s
    assert p["train"].seconds == pytest.approx(38_535_168)
    assert proj.total_seconds == pytest.approx(8_000_000 + 1_600_000 + 38_535_168)
    assert proj.disk_bytes == pytest.approx(860.16e9)


def test_the_assumptions_name_each_rule_with_its_numbers():
    a = pipeline.project(fake_stages(), OURS, KIMI_K25, 10_000, 2000, 5).assumptions
    assert len(a) == 7
    workload, fmt, active, gpus, fixed, train, gpu_type = a
    assert "10,000 x 2,000.0 = 20.00 M" in workload
    assert "bytes/token = num_aux x hidden x bytes_per_value = 3 x 7,168 x 2 = 43,008 B" in fmt
    assert "exact: it is the format" in fmt
    assert "our run stored 6,000.0 B/token" in fmt
    assert "active parameters per token" in active and "320.0x" in active
    assert "divided by 8 / 1 = 8" in gpus and "ideal tensor-parallel" in gpus and "optimistic" in gpus
    assert "engine's start" in fixed and "one sequence per request" in fixed
    assert "width squared" in train and "(7,168 / 1,000)^2 = 51.4x" in train and "5 epochs" in train
    assert "same as the measured run's" in gpu_type


def test_an_unknown_stage_projects_to_none():
    m = fake_metrics()
    del m["metrics"]["04_train_drafter"]["train.seconds"]
    proj = pipeline.project(pipeline.stages_from_metrics(m, PARAMS), OURS, KIMI_K25, 10, 100, 1)
    assert proj.stage("train").seconds is None
    assert proj.total_seconds is None
    wall, disk = pipeline.moonshot(proj)
    assert wall.ratio is None and wall.met is None
    # the disk goal is still computed: 1000 tokens of the seed's 19,252,232, far below a tenth
    assert disk.ratio == pytest.approx(1000 / 19_252_232) and disk.met is True


# ---------------------------------------------------------------------------------------------------------
# the table and the goals


def test_pipeline_rows():
    stages = fake_stages()
    proj = pipeline.project(stages, OURS, OURS, 10, 100, 4)
    rows = pipeline.pipeline_rows(stages, SEED, proj)
    assert [r["stage"] for r in rows] == ["generate", "extract", "train", "total"]
    gen, ext, _train, total = rows
    assert gen["ours s"] == 10.0 and gen["ours tok/s"] == pytest.approx(100.0) and gen["ours bytes"] is None
    assert gen["seed s"] == pytest.approx(19_080)
    assert ext["seed bytes"] == 828e9 and ext["seed tok/s"] == 3165
    assert ext["projected bytes"] == pytest.approx(6e6)
    assert total["ours s"] == pytest.approx(42.0)  # 10 + 2 + 30
    assert total["ours bytes"] == 6_000_000
    assert total["seed s"] == pytest.approx(34_523, abs=1)
    assert total["projected s"] == pytest.approx(42.0)
    columns = {f"{who} {what}" for who in ("ours", "seed", "projected") for what in ("s", "tok/s", "bytes")}
    assert set(gen) == {"stage"} | columns


def small_seed() -> SeedPipeline:
    """1 h generating, 36,000 tokens extracted at 10 tokens/s (1 h), 1 h training: 10,800 s in all."""
    return SeedPipeline(samples=10, generate_hours=1.0, extract_tokens_per_s=10.0,
                        hidden_bytes=43_008 * 36_000, train_hours=1.0)


def test_moonshot_goals_computed_against_the_seed():
    seed = small_seed()
    assert seed.total_seconds == pytest.approx(10_800)
    met = Projection([Stage("generate", 1000.0, None, None),
                      Stage("extract", 700.0, None, None, 154_828_800),
                      Stage("train", 1000.0, None, None)])
    wall, disk = pipeline.moonshot(met, seed)
    assert wall.ratio == pytest.approx(0.25) and wall.goal == 0.25 and wall.met  # 2700 / 10,800
    assert disk.ratio == pytest.approx(0.1) and disk.goal == 0.1 and disk.met  # a tenth of 1,548,288,000
    missed = Projection([Stage("generate", 1000.0, None, None),
                         Stage("extract", 800.0, None, None, 309_657_600),
                         Stage("train", 1000.0, None, None)])
    wall, disk = pipeline.moonshot(missed, seed)
    assert wall.ratio == pytest.approx(2800 / 10_800) and not wall.met
    assert disk.ratio == pytest.approx(0.2) and not disk.met
    assert wall.row() == {"goal": "wall time (s)", "projected": 2800.0, "seed": pytest.approx(10_800),
                          "ratio": pytest.approx(0.259259, rel=1e-5), "target ratio": 0.25, "met": False}


# ---------------------------------------------------------------------------------------------------------
# the committed GPU run


@pytest.mark.skipif(not (H200_RUN / "metrics.json").is_file(), reason="the committed H200 run is not here")
def test_the_committed_h200_run():
    s = by_name(pipeline.stages_from_run(H200_RUN))
    # 03: 612,403 sample tokens (4096 samples), generated in 134.7 s, extracted at 108,131.65 tokens/s
    assert s["generate"].seconds == pytest.approx(134.725, abs=1e-3)
    assert s["generate"].tokens == 612_403
    assert s["generate"].tokens_per_s == pytest.approx(4545.6, abs=0.1)  # 612,403 / 134.725
    assert s["extract"].seconds == pytest.approx(5.6635, abs=1e-4)  # 612,403 / 108,131.65
    assert s["extract"].bytes == 3_769_118_779
    # 04: 1536 steps / ceil(4096 / 16) = 6 epochs -> 3,674,418 passes in 174.63 s
    assert s["train"].tokens == 3_674_418
    assert s["train"].seconds == pytest.approx(174.630, abs=1e-3)

    shape = pipeline.shape_from_run(H200_RUN)
    assert shape == TargetShape(hidden_size=1024, num_layers=16, active_params=147_587_072, num_aux=3,
                                bytes_per_value=2, gpus=1)
    assert shape.bytes_per_token == 6144  # 3 x 1024 x 2; the run stored 6154.6 B/token with its headers

    proj = pipeline.project(list(s.values()), shape, KIMI_K25, 10_000, SEED.tokens_per_sample, 5)
    p = by_name(proj.stages)
    # the seed's workload, so the seed's bytes: 19,252,232 x 43,008 = 828 GB
    assert p["extract"].bytes == pytest.approx(828e9)
    # factor 32e9 / 147,587,072 / 8 = 27.1024; 19,252,232 / 108,131.65 x 27.1024 = 4825 s
    assert p["extract"].seconds == pytest.approx(4825, rel=1e-3)
    # 96,261,161 passes at 174.63 / 3,674,418 s x (7168 / 1024)^2 = 49 -> 224,170 s
    assert p["train"].seconds == pytest.approx(224_170, rel=1e-3)
    assert math.isclose(pipeline.moonshot(proj)[1].ratio, 1.0)


# ---------------------------------------------------------------------------------------------------------
# 04's section


def test_a_cpu_run_gets_its_stages_and_no_projection():
    params = {**PARAMS, "engine": {"device": "cpu", "tensor_parallel_size": 1}}
    section = pipeline.report_for_run(fake_metrics(), params)
    assert section.projection is None and "ran on cpu" in section.reason
    rows = {r["stage"]: r for r in section.rows()}
    assert list(rows) == ["generate", "extract", "train", "total"]
    assert not any(k.startswith("projected") for k in rows["extract"])
    # 6,000,000 bytes, 2 s at 500 tokens/s; the seed's 828 GB and 5.3 h; the total is 10 + 2 + 30 s
    assert rows["extract"]["this run: bytes"] == "6.00 MB"
    assert rows["extract"]["this run: wall"] == "2.00 s" and rows["extract"]["this run: tokens/s"] == "500"
    assert rows["extract"]["seed: bytes"] == "828.00 GB" and rows["generate"]["seed: wall"] == "5.30 h"
    assert rows["total"]["this run: wall"] == "42.0 s"
    assert section.goal_rows() == []
    m = section.metrics()
    assert m["pipeline.extract.bytes"] == 6_000_000 and "pipeline.kimi_projection.seconds" not in m


def test_a_gpu_run_is_projected_to_kimi():
    params = {**PARAMS, "engine": {"device": "cuda", "tensor_parallel_size": 1}}
    section = pipeline.report_for_run(fake_metrics(), params)
    assert section.reason is None
    # the disk at Kimi's widths: 19.25 M sample tokens x 43,008 B = the seed's 828 GB (same token count)
    assert section.metrics()["pipeline.kimi_projection.bytes"] == pytest.approx(828e9)
    goals = {g["goal"]: g for g in section.goal_rows()}
    assert goals["disk"]["projected / seed"] == pytest.approx(1.0) and goals["disk"]["met"] is False
    assert {r["stage"]: r for r in section.rows()}["extract"]["projected: bytes"] == "828.00 GB"


def test_a_gpu_run_without_a_shape_says_what_is_missing():
    params = {"engine": {"device": "cuda:0"}, "data": {"hidden_dtype": "bfloat16"}}
    section = pipeline.report_for_run(fake_metrics(), params)
    assert section.projection is None and "hidden_size" in section.reason


def test_a_cut_run_is_read_from_its_step_files(tmp_path):
    """A run cut before the runner wrote metrics.json (a device budget ran out) keeps metrics/<notebook>.json."""
    (tmp_path / "metrics").mkdir()
    for step, values in METRICS["metrics"].items():
        (tmp_path / "metrics" / f"{step}.json").write_text(json.dumps(values))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    assert pipeline.stages_from_run(tmp_path) == pipeline.stages_from_metrics(METRICS, PARAMS)
    with pytest.raises(FileNotFoundError, match="metrics"):
        pipeline.read_run(tmp_path / "nothing")
