"""``eagle3lab compare``: several run folders side by side on one offline page."""

import json

import yaml

from eagle3lab import cli, compare, report


def _run(folder, k, tau, ids, conditional):
    folder.mkdir(parents=True)
    (folder / "index.html").write_text("<html></html>")
    (folder / "params.yaml").write_text(yaml.safe_dump(
        {"profile": "smoke", "drafter": {"aux_layer_ids": ids}, "acceptance": {"num_speculative_tokens": k}}))
    metrics = {"05_acceptance": {"acceptance.k": k, "acceptance.mean_acceptance_length": tau,
                                 "acceptance.conditional_rate": conditional,
                                 "acceptance.tau_by_k": {str(i): 1 + 0.5 * i for i in range(1, 4)}},
               "00_target": {"target.params": 1000}}
    (folder / "metrics.json").write_text(json.dumps(
        {"run": {"profile": "smoke", "overrides": [f"drafter.aux_layer_ids={ids}"]}, "ok": True, "steps": [],
         "metrics": metrics}))
    return folder


def test_compare_page_shows_what_differs(tmp_path):
    a = _run(tmp_path / "runs" / "a", 3, 2.5, [1, 2, 4], [0.9, 0.8, 0.7])
    b = _run(tmp_path / "runs" / "b", 3, 1.75, [2, 3, 4], [0.6, 0.5, 0.4])
    out = tmp_path / "cmp"
    assert cli.main(["compare", str(a), str(b), "--out", str(out)]) == 0
    page = (out / "compare.html").read_text()
    assert "drafter.aux_layer_ids" in page and "[1, 2, 4]" in page and "[2, 3, 4]" in page
    assert "acceptance.num_speculative_tokens" not in page  # the same in both runs
    assert "<td class='diff'>2.5 of a possible 4</td><td class='diff'>1.75 of a possible 4</td>" in page
    assert "<td class=''>1,000</td><td class=''>1,000</td>" in page  # equal values are not highlighted
    assert '<a href="../runs/a/index.html">a</a>' in page
    assert page.count('class="plotly-graph-div"') == 2 and (out / report.PLOTLY_JS).is_file()
    assert report.external_scripts(page) == []


def test_compare_refuses_what_is_not_a_run(tmp_path, capsys):
    a = _run(tmp_path / "a", 3, 2.5, [1, 2, 4], [0.9])
    assert cli.main(["compare", str(a), str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert cli.main(["compare", str(a)]) == 2


def test_differing_params_lists_each_runs_value(tmp_path):
    runs = [compare.load_run(_run(tmp_path / n, k, 2.0, [1, 2, 4], [0.5])) for n, k in (("x", 3), ("y", 5))]
    assert compare.differing_params(runs) == [("acceptance.num_speculative_tokens", [3, 5])]
