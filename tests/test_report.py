"""Report building blocks: noise removal, offline export with one plotly.js per folder, the overview page,
the display helpers' contract (one display, no return value) and the lab profile choice."""

import json
import sys
from pathlib import Path

import nbformat
import plotly.graph_objects as go
import pytest
import yaml

from eagle3lab import acceptance as A
from eagle3lab import overview, progress, report, workbook
from eagle3lab.vllm_compat import REFUSAL_MESSAGE

TQDM_REFRESHES = (
    "\rtarget training:   0%|          | 0/30 [00:00<?, ?it/s]"
    "\rtarget training:  47%|####7     | 14/30 [00:02<00:03,  5.31it/s, loss=5.470]"
    "\rtarget training: 100%|##########| 30/30 [00:04<00:00,  6.05it/s, loss=5.067]\n"
)
IPROGRESS = ("/x/tqdm/auto.py:21: TqdmWarning: IProgress not found. Please update jupyter and ipywidgets.\n"
             "  from .autonotebook import tqdm as notebook_tqdm\n")
REAL_WARNING = "/x/y.py:3: UserWarning: the checkpoint has no generation_config\n"


def test_progress_noise_is_dropped_and_real_warnings_kept():
    assert report.drop_progress_noise(TQDM_REFRESHES) == ""
    assert report.drop_progress_noise(IPROGRESS) == ""
    assert report.drop_progress_noise(TQDM_REFRESHES + REAL_WARNING) == REAL_WARNING


def _figure():
    fig = go.Figure(go.Bar(x=[1, 2], y=[0.25, 0.8123456]))
    fig.update_layout(title="acceptance")
    return fig


def _notebook():
    nb = nbformat.v4.new_notebook()
    fig_json = json.loads(_figure().to_json())
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    code = nbformat.v4.new_code_cell("show(fig)")
    code.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text=TQDM_REFRESHES + IPROGRESS),
        nbformat.v4.new_output("stream", name="stderr", text=REAL_WARNING),
        nbformat.v4.new_output("display_data", data={report.PLOTLY_MIME: fig_json, "text/plain": "<fig>"}),
        # a figure shown interactively: plotly.js inline in its HTML fallback
        nbformat.v4.new_output("display_data", data={
            report.PLOTLY_MIME: fig_json, "text/html": report.figure_html(_figure(), include_plotlyjs=True)}),
        nbformat.v4.new_output("display_data", data={report.WIDGET_MIME: {"model_id": "a"},
                                                     "text/html": "<p>static explorer view</p>"}),
        nbformat.v4.new_output("display_data", data={report.WIDGET_MIME: {"model_id": "b"}, "text/plain": "w"}),
    ]
    injected = nbformat.v4.new_code_cell('# Parameters\nparams = {"profile": "smoke", "seed": 0}\nrun_dir = "/r"\n')
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), code, injected]
    return nb


def test_clean_outputs_keeps_content_only():
    nb = report.clean_outputs(_notebook())
    outs = nb.cells[1].outputs
    assert "widgets" not in nb.metadata  # else nbconvert adds a CDN loader for widget state
    assert [o.output_type for o in outs] == ["stream", "display_data", "display_data", "display_data"]
    assert outs[0].text == REAL_WARNING
    for o in outs[1:3]:
        assert report.PLOTLY_MIME not in o.data and "Plotly.newPlot" in o.data["text/html"]
        assert not report.inline_plotly_js(o.data["text/html"])
    assert outs[3].data == {"text/html": "<p>static explorer view</p>"}  # the bare widget "b" is gone
    # papermill's one-line profile dict is replaced by a pointer to params.yaml; run_dir stays
    assert "params =" not in nb.cells[2].source and 'run_dir = "/r"' in nb.cells[2].source


def test_export_stores_plotly_js_once_and_loads_it_relatively(tmp_path):
    src = tmp_path / "nb.ipynb"
    nbformat.write(_notebook(), str(src))
    pages = [report.export_html(src, tmp_path / f"p{i}.html") for i in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nb.ipynb", "p0.html", "p1.html", "plotly.min.js"]
    for p in pages:
        text = p.read_text()
        assert '<script src="plotly.min.js"></script>' in text
        assert report.external_scripts(text) == [] and not report.inline_plotly_js(text)
        assert "0.8123456" in text and "IProgress" not in text and "it/s" not in text
        assert p.stat().st_size < 1_000_000
    assert (tmp_path / "plotly.min.js").read_text().startswith("/**\n* plotly.js v")


def test_external_scripts_flags_anything_not_relative():
    page = ('<script src="plotly.min.js"></script><script src="https://cdn.x/a.js"></script>'
            '<script src="//cdn.y/b.js"></script><script src="/abs.js"></script><script>var a;</script>')
    assert report.external_scripts(page) == ["https://cdn.x/a.js", "//cdn.y/b.js", "/abs.js"]


def test_cdn_plotly_is_refused():
    with pytest.raises(ValueError):
        report.figure_html(_figure(), include_plotlyjs="cdn")


def test_number_text_drops_padding_and_shows_missing_as_a_dash():
    cases = {4.7: "4.7", 0.162: "0.162", 1.58: "1.58", 0.72289: "0.7229", 12885.3: "12,885.3", 5781504: "5,781,504",
             512.0: "512", 0.0: "0", -0.25: "-0.25", 0.00012345: "0.000123", float("nan"): "–", True: "True"}
    assert {v: report.number_text(v) for v in cases} == cases


def test_table_cells_use_number_text(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: shown.append(a[0]))
    report.table([{"set": "a", "seconds": 4.7, "acc": 0.162}, {"set": "skipped", "seconds": float("nan"), "acc": 0.5}])
    html = shown[0].to_html()
    assert ">4.7<" in html and ">0.162<" in html and ">–<" in html and ">skipped<" in html
    assert "4.7000" not in html and "nan" not in html


def test_table_and_show_display_once_and_return_none(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: shown.append(a[0]))
    monkeypatch.setenv(progress.BATCH_ENV, "1")
    assert report.table({"tau": 1.5, "ids": [1, 2, 4]}) is None
    assert report.table([{"a": 1, "b": [3, 4]}]) is None
    assert report.show(_figure()) is None
    assert len(shown) == 3
    assert list(shown[0].data["value"]) == ["1.5", "1, 2, 4"] and list(shown[1].data["b"]) == ["3, 4"]
    assert report.PLOTLY_MIME in shown[2] and "text/html" not in shown[2]  # batch: no plotly.js in the record
    monkeypatch.setenv(progress.BATCH_ENV, "0")
    report.setup_notebook_display()
    report.show(_figure())
    report.show(_figure())
    assert report.inline_plotly_js(shown[3]["text/html"])  # interactive: the first figure carries plotly.js
    assert not report.inline_plotly_js(shown[4]["text/html"])


def test_progress_is_silent_in_batch_runs(monkeypatch):
    monkeypatch.setenv(progress.BATCH_ENV, "1")
    assert progress.progress(range(3), desc="x").disable
    monkeypatch.delenv(progress.BATCH_ENV)
    assert not progress.progress(range(3), desc="x", file=sys.stderr).disable
    assert progress.progress(range(3), disable=True).disable


def test_vllm_logs_are_routed_to_a_file(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "1")
    cfg = report.route_vllm_logs(tmp_path / "logs" / "vllm.log")
    config = json.loads(cfg.read_text())
    assert config["handlers"]["file"]["filename"] == str((tmp_path / "logs" / "vllm.log").resolve())
    assert config["loggers"]["vllm"]["propagate"] is False
    import os

    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(cfg)
    assert report.route_vllm_logs(tmp_path / "other.log") is None  # a config is set: left alone


def test_workbook_record_conclude_caveat(tmp_path):
    from eagle3lab import params

    p = params.load(workbook.repo_root() / "tests" / "smoke.yaml")
    wb = workbook.Workbook("05_acceptance", p, tmp_path)
    assert wb.record("acceptance.k", 3) is None
    wb.conclude("tau = 2 of 4")
    wb.caveat("loops")
    wb.caveat("loops")
    m = workbook.read_metrics(tmp_path, "05_acceptance")
    assert m == {"acceptance.k": 3, "conclusion": "tau = 2 of 4", "caveats": ["loops"]}


def test_lab_profile_choice(tmp_path, monkeypatch):
    (tmp_path / "params").mkdir()
    for name in ("embedded", "other"):
        (tmp_path / "params" / f"{name}.yaml").write_text("profile: x\n")
    monkeypatch.delenv("EAGLE3LAB_PARAMS", raising=False)
    assert workbook.lab_params_file(tmp_path) == tmp_path / "params" / "embedded.yaml"
    (tmp_path / workbook.LAB_CHOICE).parent.mkdir()
    (tmp_path / workbook.LAB_CHOICE).write_text(str(tmp_path / "params" / "other.yaml") + "\n")
    assert workbook.lab_params_file(tmp_path) == tmp_path / "params" / "other.yaml"
    monkeypatch.setenv("EAGLE3LAB_PARAMS", "/x/y.yaml")
    assert str(workbook.lab_params_file(tmp_path)) == "/x/y.yaml"
    assert str(workbook.lab_params_file(tmp_path, "/a.yaml")) == "/a.yaml"


METRICS = {
    "00_target": {"target.params": 208384, "target.heldout_ppl": 170.17, "target.unigram_entropy": 5.29,
                  "target.train_steps_done": 30, "target.train_seconds": 5.6},
    "02_patch": {"patch.verdict": "supported", "conclusion": "3 of 3 classes pass after the patch.",
                 "patch.before.KimiK25ForConditionalGeneration.supports_eagle3": False,
                 "patch.after.KimiK25ForConditionalGeneration.supports_eagle3": True,
                 "patch.engine.refused_without_patch": True, "patch.engine.served_with_patch": True,
                 "patch.engine.workers": [{"rank": 0}], "patch.engine.refusal_message": "Model does not support"},
    "05_acceptance": {"acceptance.k": 3, "acceptance.mean_acceptance_length": 3.48, "acceptance.tau_ci95": [3.3, 3.6],
                      "acceptance.conditional_rate": [0.895, 0.908, 0.954],
                      "acceptance.cumulative_rate": [0.895, 0.813, 0.776], "acceptance.modelled_speedup": 2.1,
                      "acceptance.cost_ratio": 0.18, "acceptance.degenerate": True,
                      "acceptance.degenerate_reason": "77% of rounds accept every draft: the continuations are loops."},
}
STEPS = [{"name": n, "status": "ok", "seconds": 1.0, "html": f"{n}.html", "ipynb": f"{n}.ipynb", "error": ""}
         for n in METRICS]


def test_overview_page_groups_figures_with_context():
    page = overview.index_html("run", STEPS, METRICS, {"profile": "smoke"})
    assert "3.48 of a possible 4" in page and "95% interval over prompts 3.3 - 3.6" in page
    assert "89.5% / 90.8% / 95.4%" in page and "conditional acceptance per position" in page
    assert "MODELLED" in page and "measured speedup</td><td class='val'>not measured" in page
    assert "3 of 3 classes pass after the patch." in page  # the notebook's own conclusion wins
    assert "refused without the patch, served with it" in page and "1 worker(s)" in page
    assert "Trained a 208,384-parameter target" in page  # derived when the notebook gave none
    assert "class='caveat'>&#9888; Degenerate data: 77% of rounds" in page
    assert page.count('class="plotly-graph-div"') == 1 and '<script src="plotly.min.js">' in page
    assert report.external_scripts(page) == []


def test_overview_without_caveats_or_acceptance_has_no_banner_and_no_figure():
    m = {k: v for k, v in METRICS.items() if k != "05_acceptance"}
    page = overview.index_html("run", STEPS[:2], m, {})
    assert "class='caveat" not in page and "plotly" not in page


def test_overview_failed_run_says_so():
    steps = [dict(STEPS[0], status="failed", error="RuntimeError: boom (cell [3])"),
             dict(STEPS[1], status="skipped", html="", ipynb="")]
    page = overview.index_html("run", steps, {}, {})
    assert "The run failed at 00_target" in page and "RuntimeError: boom" in page


def test_run_log_gets_real_warnings_only(tmp_path):
    from eagle3lab import runner

    path = tmp_path / "nb.ipynb"
    nb = _notebook()
    nb.cells[1].execution_count = 4
    nbformat.write(nb, str(path))
    assert runner.cell_warnings(path) == ["cell [4]: /x/y.py:3: UserWarning: the checkpoint has no generation_config"]


def test_run_facts_read_as_text_on_the_index() -> None:
    from eagle3lab.overview import run_fact

    resumed = [{"at": "2026-12-01T18:14:38+00:00", "host": "vm", "rerun": ["02_patch", "03_engine"]},
               {"at": "2026-12-01T18:20:00+00:00", "host": "vm", "rerun": ["05_acceptance"]}]
    assert run_fact(resumed) == ("2026-12-01T18:14:38+00:00 on vm: ran the steps not done before: 02_patch, 03_engine; "
                                 "2026-12-01T18:20:00+00:00 on vm: ran the steps not done before: 05_acceptance")
    assert run_fact(["-p", "seed=1"]) == "-p seed=1"
    assert run_fact([]) == "-"
    assert run_fact("embedded") == "embedded"
    assert run_fact({"torch": "2.13.0+cpu", "vllm": "0.26.0"}) == "torch 2.13.0+cpu, vllm 0.26.0"
    assert run_fact({}) == "-"


def test_overview_of_the_h200_run_explains_mismatches_and_qualifies_the_measured_speedup():
    """Read back the metrics the GPU workbook recorded on 2026-12-03 (tests/fixtures/gpu-runs/20261203-h200) and check what
    the index says of them: a measured slowdown at batch 64 must say what it measured, mismatches must say where
    the outputs part, and the per-layer probe reads in layer order."""
    import json
    run = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu-runs/20261203-h200"
    m = overview.merged(json.loads((run / "metrics.json").read_text())["metrics"])
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    assert rows["measured speedup"].value == "0.258x"
    assert "the same 64 prompts decoded at once" in rows["measured speedup"].context
    greedy = rows["outputs equal greedy decoding"]
    assert greedy.value == "no"
    assert greedy.context.startswith("15 of 64 prompts differ, first at token 4 or later; 14 of 15 part where")
    probe = rows["probe top-1 per layer"].value
    assert probe.startswith("1: 44.0%, 2: 49.2%, 3: 53.4%") and probe.endswith("16: 87.6%")
    assert "measured speedup, batch 1" not in rows  # that run did not time prompts one at a time


def test_overview_shows_the_batch1_speedup_with_its_figures():
    m = overview.merged({"05_acceptance": {"acceptance.measured_speedup": 0.3, "acceptance.decoded_prompts": 64,
                                           "acceptance.measured_speedup_batch1": 1.42, "acceptance.batch1_prompts": 16,
                                           "acceptance.batch1_tokens_per_s": {"baseline": 300.0, "eagle3": 426.0}}})
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    assert rows["measured speedup, batch 1"].value == "1.42x"
    assert rows["measured speedup, batch 1"].context == (
        "MEASURED: output tokens/s one prompt at a time, 16 prompts, warm engines: 426 with EAGLE-3 against 300 without")


def test_overview_of_the_third_1203_gpu_run_reads_its_batch1_figures():
    """tests/fixtures/gpu-runs/20261203-h200-c: the first GPU run of 05 with batch-1 timing. EAGLE-3 was slower at batch 1
    (334.7 vs 396.4 tok/s) while transformers-timed c = 0.05 modelled 2.2x: the index must show the engine's own
    draft cost beside it, and must not call the batch-64 figure (1.22x, a gain) an overhead loss."""
    import json
    run = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu-runs/20261203-h200-c"
    m = overview.merged(json.loads((run / "metrics.json").read_text())["metrics"])
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    assert rows["measured speedup, batch 1"].value == "0.844x"
    ctx = rows["measured speedup, batch 1"].context
    assert "335 with EAGLE-3 against 396 without" in ctx
    assert "one draft step costs the engine 0.651 of a target step" in ctx and "c = 0.0497" in ctx
    assert rows["measured speedup"].value == "1.22x" and "outweighs" not in rows["measured speedup"].context


def test_recorded_gpu_02_refusal_and_patch() -> None:
    """tests/fixtures/gpu-runs/20261204-h200-b: 02 on one H200 with the current code. A real engine refused without the
    patch with vLLM's own message, and served with it, its worker running our forward on the aux layers asked."""
    run = Path(__file__).resolve().parents[1] / "tests/fixtures/gpu-runs/20261204-h200-b"
    m = json.loads((run / "metrics/02_patch.json").read_text())
    assert m["patch.engine.refused_without_patch"] and m["patch.engine.served_with_patch"]
    assert m["patch.engine.refusal_message"] == REFUSAL_MESSAGE
    (w,) = m["patch.engine.workers"]
    assert w["supports_eagle3"] and w["eagle3lab_forward"] and w["aux_layers"] == [2, 8, 13]
    steps = {s["name"]: s["status"] for s in json.loads((run / "metrics.json").read_text())["steps"]}
    assert steps["02_patch"] == "ok" and steps["05_acceptance"] == "pending"
    # What the run's index page makes of this record (library code, not the file): the refusal, then the patch.
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    row = rows["real vLLM engine"]
    assert row.value == "refused without the patch, served with it"
    assert "1 worker(s) reported the patched classes" in row.context and REFUSAL_MESSAGE in row.context
    # ... and a record where the patched engine did not start says so
    failed = {**m, "patch.engine.served_with_patch": False}
    bad = {r.label: r for g in overview.headline(failed) for r in g.rows}["real vLLM engine"]
    assert bad.value == "refused without the patch, FAILED with it"


def test_recorded_gpu_full_workbook_on_vllm() -> None:
    """benchmarks/gpu/20261204-h200-c: 00-05 in one run folder on one H200 with the compiled vLLM engine. The
    recorded counters are re-added here: τ from vLLM's drafts and accepted tokens, and its gap to the reference
    decoder per position, against the tolerance the page states."""
    run = Path(__file__).resolve().parents[1] / "benchmarks/gpu/20261204-h200-c/workbook"
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["ok"] and [s["status"] for s in summary["steps"]] == ["ok"] * 6
    for s in summary["steps"]:
        assert (run / s["html"]).is_file()
    engine = yaml.safe_load((run / "params.yaml").read_text())["engine"]
    assert engine["kind"] == "vllm" and engine["enforce_eager"] is False
    m = {k: json.loads((run / f"metrics/{k}.json").read_text()) for k in ("02_patch", "03_engine", "05_acceptance")}
    assert m["02_patch"]["patch.engine.refused_without_patch"] and m["02_patch"]["patch.engine.served_with_patch"]
    assert m["03_engine"]["data.engine"] == "vllm" and m["03_engine"]["data.num_samples"] == 4096
    acc = m["05_acceptance"]
    stats = acc["acceptance.decoded_stats"]
    # vLLM's raw counters through our SpecDecodeStats: tau and the per-position rates the record states.
    engine = A.SpecDecodeStats(num_drafts=stats["num_drafts"], num_draft_tokens=stats["num_draft_tokens"],
                               num_accepted_tokens=stats["num_accepted_tokens"],
                               accepted_per_pos=stats["accepted_per_pos"])
    assert engine.mean_acceptance_length == pytest.approx(stats["mean_acceptance_length"], rel=1e-12)
    assert engine.mean_acceptance_length == pytest.approx(1 + 5025 / 3185) and engine.mean_acceptance_length >= 2.5
    assert engine.per_position_rate == pytest.approx(acc["acceptance.engine_per_position"], rel=1e-12)
    assert sum(stats["accepted_per_pos"]) == stats["num_accepted_tokens"]
    # The gap to the reference decoder, as engine_vs_reference computes it (the reference's rates as counters
    # over 10^6 rounds: exact to 5e-7), against the recorded gap and verdict.
    n = 10**6
    ref = A.SpecDecodeStats(num_drafts=n, accepted_per_pos=[round(r * n) for r in acc["acceptance.reference_per_position"]])
    side = A.engine_vs_reference(engine, ref)
    assert side.max_gap == pytest.approx(acc["acceptance.engine_reference_max_gap"], abs=1e-4)
    assert side.agree is acc["acceptance.engine_reference_agree"] is True
    # the page says outputs are not all equal to greedy; the record agrees with itself on how many differ
    assert not acc["acceptance.outputs_match_greedy"]
    assert acc["acceptance.mismatching_prompts"] == len(acc["acceptance.first_divergence"]) == 8


def test_overview_reads_mismatches_against_the_measured_precision_error():
    dv = {"differing_at_a_token": 3, "near_ties": 1, "ties_within_bf16_steps": 4.0, "within_measured_error": 2,
          "yardstick": 0.3731, "yardstick_share": 0.001,
          "precision_error": {"dtype": "bfloat16", "margin_error_max": 0.5608, "argmax_flip_rate": 0.0142}}
    m = overview.merged({"05_acceptance": {"acceptance.outputs_match_greedy": False, "acceptance.mismatching_prompts": 3,
                                           "acceptance.decoded_prompts": 64, "acceptance.divergence": dv,
                                           "acceptance.first_divergence": {"4": 30, "9": 12, "11": 70}}})
    rows = {r.label: r for g in overview.headline(m) for r in g.rows}
    assert rows["outputs equal greedy decoding"].context == (
        "3 of 64 prompts differ, first at token 12 or later; 2 of 3 part where the float32 margin is within what "
        "bfloat16 rounding of this target was measured to move a margin by at 0.10% of positions (0.373; its argmax "
        "leaves float32's at 1.42% of positions)")


def test_members_before_after_figure_marks_what_the_patch_added():
    from eagle3lab.diagnose.figures import members_before_after_figure

    members = ["get_eagle3_default_aux_hidden_state_layers", "set_aux_hidden_state_layers", "supports_eagle3"]

    def row(arch, present, ok):
        return {"arch": arch, "protocol_members": members, "members_present": present, "supports_eagle3": ok}

    before = [row("Glm4MoeForCausalLM", [], False), row("MixtralForCausalLM", ["supports_eagle3"], False)]
    after = [row("Glm4MoeForCausalLM", members, True), row("MixtralForCausalLM", members, True)]
    fig = members_before_after_figure(before, after, simulated=False)
    top, bottom = fig.data
    assert list(top.x) == [*members, "isinstance(SupportsEagle3)"] and list(top.y) == ["Glm4MoeForCausalLM",
                                                                                       "MixtralForCausalLM"]
    assert [list(r) for r in top.z] == [[0, 0, 0, 0], [0, 0, 1, 0]]
    assert [list(r) for r in bottom.z] == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert fig.layout.annotations[0].text == "before the patch"
    assert members_before_after_figure(before, after, simulated=True).layout.annotations[0].text.endswith(
        "(simulated legacy)")
