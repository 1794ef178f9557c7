"""Several runs side by side: ``eagle3lab compare RUN_A RUN_B ...`` writes one offline page.

Typical uses: the same profile with different aux-layer sets (``-p drafter.aux_layer_ids=...``), different
profiles, or different ``k``. The page lists the parameters that differ between the runs, then every
headline figure of the runs' index pages (:func:`eagle3lab.overview.headline`) in one row per figure and
one column per run, with the values that differ marked, and two figures: tau against k and acceptance per
draft position, one trace per run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from eagle3lab import overview, report
from eagle3lab.errors import InputError


@dataclass
class RunRecord:
    """What a run folder says about itself (its metrics.json and params.yaml)."""

    path: Path
    info: dict[str, Any]
    ok: bool
    metrics: dict[str, dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The run folder's name."""
        return self.path.name

    @property
    def merged(self) -> dict[str, Any]:
        """All notebooks' metrics in one dict."""
        return overview.merged(self.metrics)


def load_run(path: str | Path) -> RunRecord:
    """Read a run folder; :class:`InputError` naming the folder when it is not one."""
    p = Path(path)
    mfile = p / "metrics.json"
    if not mfile.is_file():
        raise InputError([(str(p), "not a run folder (no metrics.json)")])
    summary = json.loads(mfile.read_text())
    pfile = p / "params.yaml"
    params = yaml.safe_load(pfile.read_text()) if pfile.is_file() else {}
    return RunRecord(p.resolve(), summary.get("run", {}), bool(summary.get("ok")), summary.get("metrics", {}),
                     flatten(params or {}))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as ``{"a.b.c": value}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differing_params(runs: list[RunRecord]) -> list[tuple[str, list[Any]]]:
    """The parameters whose values are not the same in every run, with each run's value."""
    keys = sorted({k for r in runs for k in r.params})
    rows = []
    for k in keys:
        vals = [r.params.get(k, "(unset)") for r in runs]
        if any(json.dumps(v, sort_keys=True) != json.dumps(vals[0], sort_keys=True) for v in vals):
            rows.append((k, vals))
    return rows


def figure_table(runs: list[RunRecord]) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """Headline figures by group: ``[(group, [(label, [value per run])])]``; '-' where a run lacks one."""
    per_run = [{(g.title, r.label): r.value for g in overview.headline(run.merged) for r in g.rows} for run in runs]
    order: list[tuple[str, str]] = []
    for d in per_run:
        order.extend(key for key in d if key not in order)
    groups: dict[str, list[tuple[str, list[str]]]] = {}
    for title, label in order:
        groups.setdefault(title, []).append((label, [d.get((title, label), "-") for d in per_run]))
    return list(groups.items())


def figures(runs: list[RunRecord]) -> list[Any]:
    """tau against k, and acceptance per draft position, one trace per run (only what the runs recorded)."""
    import plotly.graph_objects as go

    out = []
    tau_fig = go.Figure()
    for r in runs:
        m = r.merged
        tbk = m.get("acceptance.tau_by_k")
        if tbk:
            ks = sorted(int(k) for k in tbk)
            tau_fig.add_scatter(x=ks, y=[tbk[str(k)] for k in ks], mode="lines+markers", name=r.name)
        elif m.get("acceptance.mean_acceptance_length") is not None and m.get("acceptance.k"):
            tau_fig.add_scatter(x=[m["acceptance.k"]], y=[m["acceptance.mean_acceptance_length"]], mode="markers",
                                name=r.name, marker_size=10)
    if tau_fig.data:
        kmax = max(max(t.x) for t in tau_fig.data)
        tau_fig.add_scatter(x=[1, kmax], y=[2, kmax + 1], mode="lines", line_dash="dot", line_color="#888",
                            name="ceiling k + 1")
        tau_fig.update_layout(title="Mean acceptance length tau against k (T=0, held-out prompts)",
                              xaxis_title="k (drafts per round)", yaxis_title="tau (tokens per target forward)",
                              xaxis_dtick=1, height=400)
        out.append(tau_fig)
    pos_fig = go.Figure()
    for r in runs:
        m = r.merged
        rates = m.get("acceptance.conditional_rate") or m.get("acceptance.cumulative_rate") \
            or m.get("acceptance.per_position_rate")
        kind = "conditional" if m.get("acceptance.conditional_rate") else "cumulative"
        if rates:
            pos_fig.add_bar(x=list(range(1, len(rates) + 1)), y=rates, name=f"{r.name} ({kind})")
    if pos_fig.data:
        pos_fig.update_layout(title="Acceptance per draft position", xaxis_title="draft position", xaxis_dtick=1,
                              yaxis_title="acceptance rate", yaxis_range=[0, 1], barmode="group", height=400)
        out.append(pos_fig)
    return out


def compare_html(runs: list[RunRecord], out_dir: Path) -> str:
    """The comparison page for ``runs``, with links relative to ``out_dir`` (where it will be written)."""
    e = report.escape
    head = "".join(f"<th>{e(r.name)}</th>" for r in runs)

    def link(r: RunRecord) -> str:
        rel = os.path.relpath(r.path / "index.html", out_dir)
        return f'<a href="{e(rel)}">{e(r.name)}</a>'

    runs_rows = "".join(
        f"<tr><td>{link(r)}</td><td>{e(r.info.get('profile', '?'))}</td><td>{'ok' if r.ok else 'FAILED'}</td>"
        f"<td>{e(' '.join(r.info.get('overrides', [])) or '-')}</td><td>{e(r.info.get('started', ''))}</td></tr>"
        for r in runs)
    diffs = differing_params(runs)
    diff_rows = "".join(f"<tr><td>{e(k)}</td>" + "".join(f"<td>{e(json.dumps(v))}</td>" for v in vals) + "</tr>"
                        for k, vals in diffs)
    groups = []
    for title, rows in figure_table(runs):
        body = ""
        for label, vals in rows:
            differs = len(set(vals)) > 1
            cells = "".join(f"<td class='{'diff' if differs else ''}'>{e(v)}</td>" for v in vals)
            body += f"<tr><td>{e(label)}</td>{cells}</tr>"
        groups.append(f"<h3>{e(title)}</h3><table><tr><th>figure</th>{head}</tr>{body}</table>")
    figs = "".join(report.figure_html(f, include_plotlyjs=False) for f in figures(runs))
    caveat_html = "".join(f"<div class='caveat'>&#9888; {e(r.name)}: {e(c)}</div>"
                          for r in runs for c in overview.caveats(r.metrics))
    body = f"""<h1>{len(runs)} runs side by side</h1>{caveat_html}
<h2>Runs</h2><table><tr><th>run</th><th>profile</th><th>status</th><th>overrides</th><th>started</th></tr>
{runs_rows}</table>
<h2>Parameters that differ</h2>
{f'<table><tr><th>parameter</th>{head}</tr>{diff_rows}</table>' if diffs else '<p>none: the runs share every parameter</p>'}
<h2>Headline figures</h2><p class='ctx'>Highlighted: values that differ between the runs.</p>{''.join(groups)}
{figs}"""
    css_extra = "<style>td.diff{background:#ddf4ff;font-weight:600}</style>"
    return overview.page("eagle3lab compare", body, with_plotly=bool(figs)).replace("</head>", css_extra + "</head>")


def write_compare(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the comparison page of ``run_dirs`` (at least two) into ``out`` (a new folder
    ``outputs/compare-<timestamp>/`` by default, next to the runs' parent); returns the page's path."""
    if len(run_dirs) < 2:
        raise InputError([("compare", "needs at least two run folders")])
    runs = [load_run(p) for p in run_dirs]
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out = runs[0].path.parent / f"compare-{stamp}"
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    page = compare_html(runs, out_dir.resolve())
    if overview.FIGURE_MARK in page:
        report.write_plotly_js(out_dir)
    path = out_dir / "compare.html"
    path.write_text(page, encoding="utf-8")
    return path
