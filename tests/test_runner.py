"""The papermill runner on a tiny fake workbook: success, failure, bad input, offline HTML."""

import json
from pathlib import Path

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from eagle3lab import cli, params, report, runner


def _nb(path: Path, body: str) -> None:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    p = new_code_cell("params = None\nrun_dir = None")
    p.metadata["tags"] = ["parameters"]
    nb.cells = [
        new_markdown_cell(f"# {path.stem}"),
        p,
        new_code_cell(f"from eagle3lab.workbook import open_workbook\nwb = open_workbook({path.stem!r}, params, run_dir)"),
        new_code_cell(body),
    ]
    nbformat.write(nb, str(path))


@pytest.fixture
def workbook(tmp_path, monkeypatch):
    root = tmp_path / "wb"
    (root / "notebooks").mkdir(parents=True)
    (root / "params").mkdir()
    (root / "params" / "embedded.yaml").write_text(yaml.safe_dump({"profile": "tiny", "drafter": {"aux_layer_ids": [1, 3, 5]}}))
    monkeypatch.setenv("EAGLE3LAB_ROOT", str(root))
    return root


FIG = (
    "import plotly.graph_objects as go\n"
    "from eagle3lab.report import show\n"
    "show(go.Figure(go.Bar(x=['p1','p2'], y=[0.8123456, 0.55])))\n"
    "wb.record('acceptance.mean_acceptance_length', 2.5)\n"
    "wb.record('tiny.seed', wb.params.seed)\n"
)


def test_run_writes_record_and_offline_html(workbook):
    _nb(workbook / "notebooks" / "01_first.ipynb", FIG)
    _nb(workbook / "notebooks" / "02_second.ipynb", "wb.record('second.sum', 1 + 2)")
    res = runner.run(overrides=["seed=7"], progress=False)
    assert res.ok, res.steps
    d = res.run_dir
    assert d.parent == workbook / "outputs" and d.name.endswith("-tiny")
    for name in ("01_first", "02_second"):
        assert (d / f"{name}.ipynb").is_file() and (d / f"{name}.html").is_file()
    m = json.loads((d / "metrics.json").read_text())
    assert m["metrics"]["01_first"]["tiny.seed"] == 7  # the override reached the notebook
    assert m["metrics"]["02_second"]["second.sum"] == 3
    assert [s["status"] for s in m["steps"]] == ["ok", "ok"]
    html = (d / "01_first.html").read_text()
    assert report.external_scripts(html) == []
    assert "0.8123456" in html  # the figure's data is embedded in the page
    # plotly.js is stored once per run folder and loaded by a relative script tag, never inlined
    assert "Plotly.newPlot" in html and '<script src="plotly.min.js">' in html and not report.inline_plotly_js(html)
    assert (d / "plotly.min.js").stat().st_size > 1_000_000
    index = (d / "index.html").read_text()
    assert "01_first.html" in index and "2.5" in index
    assert yaml.safe_load((d / "params.yaml").read_text())["seed"] == 7
    assert (d / "run.log").read_text().count("ok in") == 2
    # a second run never overwrites the first
    res2 = runner.run(only=["02"], progress=False)
    assert res2.run_dir != d and [s.name for s in res2.steps] == ["02_second"]
    # the step it left out is recorded, and said on the index, so that its absence reads as chosen
    assert json.loads((res2.run_dir / "metrics.json").read_text())["run"]["left_out"] == ["01_first"]
    assert "<td>left_out</td><td>01_first</td>" in (res2.run_dir / "index.html").read_text()
    assert "left_out" not in m["run"]  # the full run left nothing out
    # the software the run ran on is part of its record, and reads as text on the index
    from importlib.metadata import version

    assert m["run"]["packages"]["torch"] == version("torch") and "transformers" in m["run"]["packages"]
    assert f"torch {version('torch')}, " in (d / "index.html").read_text()


def test_failing_notebook_is_reported_and_later_steps_skipped(workbook, capsys):
    _nb(workbook / "notebooks" / "01_ok.ipynb", "wb.record('ok.value', 1)")
    _nb(workbook / "notebooks" / "02_bad.ipynb", "raise RuntimeError('the drafter exploded')")
    _nb(workbook / "notebooks" / "03_later.ipynb", "wb.record('later.value', 1)")
    code = cli.main(["run", "--no-progress"])
    assert code == 1
    out = capsys.readouterr().out
    run_dir = Path(out.strip().splitlines()[-1].split("report: ")[1]).parent
    m = json.loads((run_dir / "metrics.json").read_text())
    assert [s["status"] for s in m["steps"]] == ["ok", "failed", "skipped"]
    assert "the drafter exploded" in m["steps"][1]["error"]
    assert m["metrics"]["01_ok"]["ok.value"] == 1 and "03_later" not in m["metrics"]
    assert "the drafter exploded" in (run_dir / "02_bad.html").read_text()
    assert not (run_dir / "03_later.ipynb").exists()
    index = (run_dir / "index.html").read_text()
    assert "failed" in index and "the drafter exploded" in index


def test_bad_params_make_no_run_folder(workbook, tmp_path, capsys):
    _nb(workbook / "notebooks" / "01_ok.ipynb", "pass")
    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: x\nengine: {kind: warp}\n")
    assert cli.main(["run", "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "engine.kind" in err and str(bad) in err
    assert cli.main(["run", "--only", "07"]) == 2
    assert not (workbook / "outputs").exists()


def test_select_notebooks_by_number_or_name(tmp_path):
    avail = [tmp_path / "00_target.ipynb", tmp_path / "01_diagnose.ipynb", tmp_path / "02_patch.ipynb"]
    assert runner.select_notebooks(avail, ["02", "01_diagnose"]) == avail[1:]
    with pytest.raises(params.ParamsError):
        runner.select_notebooks(avail, ["9"])


def test_resume_reruns_only_what_did_not_finish(workbook, tmp_path, capsys):
    flag = tmp_path / "second-may-pass"
    counter = tmp_path / "first-runs"
    _nb(workbook / "notebooks" / "01_first.ipynb",
        f"import pathlib\np = pathlib.Path({str(counter)!r})\np.write_text(str(int(p.read_text() or 0) + 1) "
        f"if p.exists() else '1')\nwb.record('first.seed', wb.params.seed)")
    _nb(workbook / "notebooks" / "02_second.ipynb",
        f"import pathlib\nassert pathlib.Path({str(flag)!r}).exists(), 'stopped here'\nwb.record('second.value', 2)")
    _nb(workbook / "notebooks" / "03_third.ipynb", "wb.record('third.value', 3)")
    first = runner.run(overrides=["seed=5"], progress=False)
    assert [s.status for s in first.steps] == ["ok", "failed", "skipped"]

    flag.touch()
    # a resumed run keeps its own params: new ones are refused before anything runs
    assert cli.main(["run", "--resume", str(first.run_dir), "-p", "seed=6"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main(["run", "--resume", str(first.run_dir), "--no-progress"]) == 0
    m = json.loads((first.run_dir / "metrics.json").read_text())
    assert [s["status"] for s in m["steps"]] == ["ok", "ok", "ok"]
    assert counter.read_text() == "1"  # 01 ended ok the first time: not executed again
    assert m["metrics"]["01_first"]["first.seed"] == 5 and m["metrics"]["03_third"]["third.value"] == 3
    assert [r["rerun"] for r in m["run"]["resumed"]] == [["02_second", "03_third"]]
    assert m["run"]["resumed"][0]["packages"] == m["run"]["packages"]  # the resumption records its own software
    assert "finished" in m["run"] and (first.run_dir / "03_third.html").is_file()
    assert "(resumed)" in (first.run_dir / "run.log").read_text()
    assert "03_third.html" in (first.run_dir / "index.html").read_text()


def test_resume_refuses_a_folder_that_is_not_a_run(workbook, tmp_path, capsys):
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_until_stops_after_a_step_and_resume_finishes(workbook, capsys):
    _nb(workbook / "notebooks" / "01_first.ipynb", "wb.record('first.value', 1)")
    _nb(workbook / "notebooks" / "02_second.ipynb", "wb.record('second.value', 2)")
    _nb(workbook / "notebooks" / "03_third.ipynb", "wb.record('third.value', 3)")
    assert cli.main(["run", "--until", "02", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "stopped early" in out
    run_dir = Path(out.split("report: ")[1].splitlines()[0]).parent
    m = json.loads((run_dir / "metrics.json").read_text())
    assert [s["status"] for s in m["steps"]] == ["ok", "ok", "pending"] and "03_third" not in m["metrics"]
    assert cli.main(["run", "--resume", str(run_dir), "--only", "03"]) == 2  # a resumed run keeps its selection
    assert cli.main(["run", "--resume", str(run_dir), "--until", "03", "--no-progress"]) == 0
    m = json.loads((run_dir / "metrics.json").read_text())
    assert [s["status"] for s in m["steps"]] == ["ok", "ok", "ok"] and m["metrics"]["03_third"]["third.value"] == 3


def test_metrics_json_is_replaced_whole_or_not_at_all(workbook, monkeypatch):
    """A run killed while it rewrites metrics.json must leave the previous file, never half of the new one: the
    summary goes to a temporary file that replaces metrics.json in one rename. The kill is simulated by a write
    that stops half way."""
    _nb(workbook / "notebooks" / "01_first.ipynb", "wb.record('first.value', 1)")
    res = runner.run(progress=False)
    path = res.run_dir / "metrics.json"
    before = path.read_text()
    real_write = Path.write_text

    def torn_write(self, data, *args, **kwargs):
        if self.name.startswith("metrics.json"):
            real_write(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError("killed mid-write")
        return real_write(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", torn_write)
    with pytest.raises(OSError, match="killed mid-write"):
        runner._write_summary(res, None, {"run": res.run_dir.name, "rewritten": True})
    monkeypatch.undo()
    assert path.read_text() == before and json.loads(before)["ok"] is True


def test_resume_names_a_corrupt_metrics_json(workbook, capsys):
    _nb(workbook / "notebooks" / "01_first.ipynb", "wb.record('first.value', 1)")
    res = runner.run(progress=False)
    (res.run_dir / "metrics.json").write_text('{"run": {"run": "x"}, "steps": [{"name": "01_fi')
    assert cli.main(["run", "--resume", str(res.run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(res.run_dir / "metrics.json") in err and "not valid JSON" in err
