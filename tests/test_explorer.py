"""The acceptance explorer's data side and widget wiring, in the kernel (the JupyterLab page: test_lab.py)."""

import pytest

from eagle3lab import explorer, report
from explorer_data import write_run


def test_options_selection_and_view(tmp_path):
    run = write_run(tmp_path / "r1")
    recs = explorer.load_records(run)
    assert explorer.options(recs) == {"drafter": ["main", "[2, 3, 4]"], "k": [1, 3], "split": ["heldout"],
                                      "temperature": [0.0]}
    sel = explorer.default_selection(run, recs)
    assert (sel.drafter, sel.k, sel.prompt_index) == ("main", 3, 0)  # k=3 has the most records
    fig, tokens = explorer.view(recs, sel)
    # pooled over the 3 prompts: rounds 4+3+3 = 10, accepted at position 1 in 3+2+... rounds
    cum = [b.y for b in fig.data][1]
    assert [round(x, 3) for x in cum] == [0.7, 0.6, 0.5]
    assert "tau = 2.75 of a possible 4" in tokens  # prompt 0: (3+3+1+0)/4 + 1
    other = explorer.view(recs, explorer.Selection(run.name, "main", 3, "heldout", 0.0, 1))[1]
    assert "tau = 3.67 of a possible 4" in other and other != tokens
    none_fig, msg = explorer.view(recs, explorer.Selection(run.name, "[2, 3, 4]", 1, "heldout", 0.0, 0))
    assert none_fig is None and "No records" in msg


def test_static_view_is_what_the_export_shows(tmp_path):
    run = write_run(tmp_path / "r1")
    recs = explorer.load_records(run)
    html = explorer.static_html(recs, explorer.default_selection(run, recs))
    assert 'class="plotly-graph-div"' in html and not report.inline_plotly_js(html) and "t9000" in html


def test_widget_updates_on_choice(tmp_path):
    pytest.importorskip("ipywidgets")
    write_run(tmp_path / "r1")
    write_run(tmp_path / "r2")
    ex = explorer.Explorer(tmp_path)
    assert [p.name for p in ex.runs] == ["r1", "r2"] and ex.run.value.name == "r2"
    assert ex.selection() == explorer.Selection("r2", "main", 3, "heldout", 0.0, 0)
    ex.prompt.value = 2
    assert ex.selection().prompt_index == 2
    ex.drafter.value = "[2, 3, 4]"  # only prompt 0 exists for the ablation drafter: the prompt follows
    assert ex.selection() == explorer.Selection("r2", "[2, 3, 4]", 3, "heldout", 0.0, 0)
    ex.k.value = 1
    assert explorer.view(ex.records(), ex.selection())[0] is None
