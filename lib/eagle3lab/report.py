"""Reports that open offline: notebook display helpers, HTML export and the run's index page.

Colleagues read our reports with no GPU and no network, so nothing may come from a CDN: plotly.js is
embedded once per notebook (plotly's ``notebook`` renderer would do it too, but only when activated in
a live front end, so we display the figure HTML ourselves), and the nbconvert template drops the
require.js and MathJax ``<script src=...>`` tags that the stock template loads from the web.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_PLOTLY_JS_SHOWN = False  # per kernel: embed plotly.js with the first figure only


def setup_notebook_display() -> None:
    """Reset the per-notebook state (called by ``open_workbook``)."""
    global _PLOTLY_JS_SHOWN
    _PLOTLY_JS_SHOWN = False


def figure_html(fig: Any, include_plotlyjs: bool) -> str:
    """The HTML of one plotly figure; plotly.js inline when asked, never from a CDN."""
    return fig.to_html(full_html=False, include_plotlyjs=bool(include_plotlyjs), config={"displaylogo": False})


def show(fig: Any) -> None:
    """Display a plotly figure so that it renders in JupyterLab and in the offline HTML report."""
    global _PLOTLY_JS_SHOWN
    from IPython.display import HTML, display

    display(HTML(figure_html(fig, include_plotlyjs=not _PLOTLY_JS_SHOWN)))
    _PLOTLY_JS_SHOWN = True


def table(rows: Any, **kwargs: Any) -> Any:
    """Display rows (a DataFrame, a list of dicts or a mapping) as a table; returns the DataFrame."""
    import pandas as pd
    from IPython.display import display

    if isinstance(rows, pd.DataFrame):
        df = rows
    elif isinstance(rows, Mapping):
        df = pd.DataFrame([{"key": k, "value": v} for k, v in rows.items()])
    else:
        df = pd.DataFrame(list(rows))
    display(df.style.hide(axis="index") if kwargs.pop("hide_index", True) else df)
    return df


# A template that extends nbconvert's lab template and empties the blocks that load scripts from a CDN.
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_jupyter_widgets -%}{%- endblock html_head_js_jupyter_widgets -%}
"""


def export_html(notebook_path: str | Path, html_path: str | Path) -> Path:
    """Export an executed notebook to a self-contained HTML file (no external scripts)."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook_path), as_version=4)
    exporter = HTMLExporter(
        template_name="lab", extra_loaders=[DictLoader({"eagle3lab_offline.html.j2": _TEMPLATE})]
    )
    exporter.template_file = "eagle3lab_offline.html.j2"
    exporter.exclude_input_prompt = False
    body, _ = exporter.from_notebook_node(nb)
    out = Path(html_path)
    out.write_text(body, encoding="utf-8")
    return out


def external_scripts(html_text: str) -> list[str]:
    """The ``src`` of every ``<script src="http...">`` in a page (must be empty for an offline report)."""
    import re

    return re.findall(r"<script[^>]*\bsrc=[\"'](https?:[^\"']+)[\"']", html_text, flags=re.I)


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        s = json.dumps(_rounded(v))
        return s if len(s) <= 80 else s[:77] + "..."
    return str(v)


def index_html(
    title: str,
    steps: Iterable[Mapping[str, Any]],
    headline: Mapping[str, Any],
    info: Mapping[str, Any],
) -> str:
    """The run's index page: each step with its status and links, the headline figures, run facts."""
    e = html.escape
    rows = []
    for s in steps:
        status = s["status"]
        color = {"ok": "#1a7f37", "failed": "#cf222e", "skipped": "#6e7781"}.get(status, "#000")
        links = " ".join(
            f'<a href="{e(s[k])}">{label}</a>' for k, label in (("html", "report"), ("ipynb", "notebook")) if s.get(k)
        )
        why = f"<div class='err'>{e(s['error'])}</div>" if s.get("error") else ""
        rows.append(
            f"<tr><td>{e(s['name'])}</td><td style='color:{color};font-weight:600'>{e(status)}</td>"
            f"<td>{s.get('seconds', 0):.1f} s</td><td>{links}</td><td>{why}</td></tr>"
        )
    head = "".join(f"<tr><td>{e(k)}</td><td>{e(_fmt(v))}</td></tr>" for k, v in headline.items())
    facts = "".join(f"<tr><td>{e(k)}</td><td>{e(_fmt(v))}</td></tr>" for k, v in info.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{e(title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:70em}}
table{{border-collapse:collapse;margin-bottom:1.5em}}td,th{{border:1px solid #d0d7de;padding:.3em .7em;
text-align:left;vertical-align:top}}.err{{color:#cf222e;white-space:pre-wrap;font-family:monospace}}</style>
</head><body><h1>{e(title)}</h1>
<h2>Steps</h2><table><tr><th>notebook</th><th>status</th><th>time</th><th>links</th><th>error</th></tr>
{''.join(rows)}</table>
<h2>Headline figures</h2><table>{head or '<tr><td>none recorded</td></tr>'}</table>
<h2>Run</h2><table>{facts}</table>
<p><a href="metrics.json">metrics.json</a> &middot; <a href="run.log">run.log</a> &middot;
<a href="params.yaml">params.yaml</a></p>
</body></html>
"""
