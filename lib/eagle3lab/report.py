"""Reports that open offline: notebook display helpers and the HTML export of executed notebooks.

Colleagues read our reports with no GPU and no network, so nothing may come from a CDN, and a run folder
must stay small. plotly.js (4.6 MB) is therefore stored once per run folder, as ``plotly.min.js`` next to
the pages, and each page loads it with a relative ``<script src>``.

In the notebook, :func:`show` displays a figure as plotly's own mime type (JupyterLab draws it with the
plotly extension that ships with the plotly package) plus, in interactive use, an HTML fallback that carries
plotly.js with the first figure of the kernel, for front ends without that extension. :func:`export_html`
rebuilds every figure's HTML from the figure's JSON without plotly.js, so the page never inlines it.

The export also drops what is not content: progress-bar refreshes (tqdm), the "IProgress not found"
warning, and widget views that cannot run offline (a widget that also carries a static rendering, such as
the explorer's, shows that rendering instead).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3lab.progress import in_batch_run

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_JS = "plotly.min.js"  # the one copy of plotly.js in a run folder, next to the pages

_PLOTLY_JS_SHOWN = False  # per kernel, interactive use only: plotly.js rides with the first figure's HTML


def setup_notebook_display(log_dir: str | Path | None = None) -> None:
    """Prepare a notebook kernel for clean output (called by ``open_workbook``).

    Resets the per-notebook figure state; in a batch run makes ``fig.show()`` emit plotly's mime type
    (never an inline plotly.js); and sends vLLM's log records (in every vLLM process started from this
    kernel) to ``<log_dir>/vllm.log`` instead of the page, when vLLM has not been imported yet.
    """
    global _PLOTLY_JS_SHOWN
    _PLOTLY_JS_SHOWN = False
    if in_batch_run():
        import plotly.io as pio

        pio.renderers.default = "plotly_mimetype"
    if log_dir is not None:
        route_vllm_logs(Path(log_dir) / "vllm.log")


def route_vllm_logs(log_file: Path) -> Path | None:
    """Point vLLM's logging at ``log_file`` through ``VLLM_LOGGING_CONFIG_PATH`` (vLLM's own mechanism).

    vLLM configures its logger when it is first imported and writes INFO lines (and benign ERROR lines
    such as "Failed to import Triton kernels" on a CPU host) to stdout, i.e. into the notebook. The config
    is inherited by vLLM's engine-core and worker processes through the environment. Does nothing when
    vLLM is already imported or the user has set their own config; returns the config path it set.
    """
    import sys

    if "vllm" in sys.modules or os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return None
    log_file.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file.resolve()),
                              "formatter": "plain", "level": "DEBUG"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    cfg = log_file.with_name("vllm-logging.json")
    cfg.write_text(json.dumps(config, indent=1))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(cfg.resolve())
    return cfg


# --------------------------------------------------------------------------------------------- display


def figure_html(fig: Any, include_plotlyjs: bool | str) -> str:
    """The HTML of one plotly figure: a div and the call that draws it; plotly.js inline only when asked.

    ``include_plotlyjs`` is plotly's argument: ``True`` (inline), ``False`` (the page provides it), or a
    path (``"plotly.min.js"``: a script tag for that file). Never a CDN.
    """
    if include_plotlyjs == "cdn":
        raise ValueError("reports never load plotly.js from a CDN")
    return fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config={"displaylogo": False})


def show(fig: Any) -> None:
    """Display a plotly figure: drawn live in JupyterLab and, once exported, in the offline HTML page."""
    global _PLOTLY_JS_SHOWN
    from IPython.display import display

    bundle: dict[str, Any] = {
        PLOTLY_MIME: json.loads(fig.to_json()),
        "text/plain": f"<plotly figure: {fig.layout.title.text or 'untitled'}>",
    }
    if not in_batch_run():
        # Front ends without plotly's JupyterLab extension fall back to this HTML.
        bundle["text/html"] = figure_html(fig, include_plotlyjs=not _PLOTLY_JS_SHOWN)
        _PLOTLY_JS_SHOWN = True
    display(bundle, raw=True)


def table(rows: Any, caption: str | None = None, hide_index: bool = True) -> None:
    """Display rows (a DataFrame, a list of dicts or a mapping) as one table. Returns None: call it as a
    statement (a returned DataFrame would be displayed a second time as the cell's ``Out[]``)."""
    import pandas as pd
    from IPython.display import display

    if isinstance(rows, pd.DataFrame):
        df = rows
    elif isinstance(rows, Mapping):
        df = pd.DataFrame([{"": k, "value": _cell(v)} for k, v in rows.items()])
    else:
        df = pd.DataFrame([{k: _cell(v, keep_float=True) for k, v in r.items()} if isinstance(r, Mapping) else r
                           for r in rows])
    styler = df.style.hide(axis="index") if hide_index else df.style
    # Left-aligned text reads better than pandas' right-aligned default for our mostly textual tables.
    styler = styler.format(number_text, subset=list(df.select_dtypes("number").columns)).set_table_styles(
        [{"selector": "th, td", "props": "text-align: left; vertical-align: top"}])
    if caption:
        styler = styler.set_caption(caption)
    display(styler)


def number_text(v: Any) -> str:
    """A table cell's number as a reader wants it: at most 4 decimals without trailing zeros (4.7, not 4.7000),
    thousands separated, 3 significant digits below 0.001, and a dash for a missing value (NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if v != v:  # NaN: a row where the figure does not apply
        return "–"
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    if 0 < abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:,.4f}".rstrip("0").rstrip(".")


def _cell(v: Any, keep_float: bool = False) -> Any:
    """Values that pandas would show as raw Python (lists, dicts) become readable text."""
    if isinstance(v, float) and not keep_float:
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(_cell(x)) for x in v)
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return v


def note(markdown_text: str) -> None:
    """Display a sentence computed at run time (markdown) as part of the narrative."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_text))


# ---------------------------------------------------------------------------------------------- export

# Lines that a progress bar or its missing-widget warning writes (tqdm's format: "desc:  40%|####  | 2/5 [..]").
_NOISE_LINE = re.compile(
    r"(\d+%\|.*\|\s*\d+(\.\d+)?[kMG]?/\d*)|(\[\d\d:\d\d<)|(\d+(\.\d+)?(it|s)/(s|it)\])|"
    r"(IProgress not found)|(from \.autonotebook import tqdm)",
)


# plotly.js inlined by ``to_html(include_plotlyjs=True)``: the page loads plotly.min.js instead.
_INLINE_PLOTLY_JS = re.compile(r"<script[^>]*>\s*/\*\*?\s*\*\s*plotly\.js v.*?</script>", re.S)


def drop_progress_noise(text: str) -> str:
    """``text`` without progress-bar refreshes and tqdm's widget warning (each ``\\r`` starts a refresh)."""
    kept = []
    for line in re.split(r"\r|\n", text):
        if line.strip() and not _NOISE_LINE.search(line):
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")


def clean_outputs(nb: Any) -> Any:
    """A copy of an executed notebook ready for the page: plotly figures rebuilt without plotly.js,
    progress noise dropped, widget views replaced by their static rendering (or dropped), widget state
    removed (nbconvert would add a CDN loader for it)."""
    import copy

    import plotly.io as pio

    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            # papermill's one-line dict of the whole profile runs off the page; the run folder has it readable.
            cell.source = ("# Parameters injected by `eagle3lab run`: the whole profile, as in params.yaml in the "
                           "run folder\n" + "\n".join(ln for ln in cell.source.splitlines() if ln.startswith("run_dir")))
        outs = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                if out.name == "stderr":
                    out.text = drop_progress_noise(out.text)
                if not out.text.strip():
                    continue
            elif out.output_type in ("display_data", "execute_result"):
                data = out.data
                if PLOTLY_MIME in data:
                    fig = pio.from_json(json.dumps(data[PLOTLY_MIME]), skip_invalid=True)
                    data["text/html"] = figure_html(fig, include_plotlyjs=False)
                    del data[PLOTLY_MIME]
                if "text/html" in data and "* plotly.js v" in data["text/html"]:
                    data["text/html"] = _INLINE_PLOTLY_JS.sub("", data["text/html"])
                if WIDGET_MIME in data:
                    del data[WIDGET_MIME]
                    if not any(m in data for m in ("text/html", "image/png", "image/svg+xml")):
                        continue  # a bare widget: nothing to show offline
            outs.append(out)
        cell.outputs = outs
    return nb


_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- if resources.eagle3lab_plotly_js -%}
<script src="{{ resources.eagle3lab_plotly_js }}"></script>
{%- endif -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def write_plotly_js(folder: str | Path) -> Path:
    """Store plotly.js once in ``folder`` (as ``plotly.min.js``) and return its path."""
    from plotly.offline import get_plotlyjs

    path = Path(folder) / PLOTLY_JS
    if not path.is_file():
        tmp = path.with_suffix(".js.tmp")
        tmp.write_text(get_plotlyjs(), encoding="utf-8")
        tmp.replace(path)
    return path


def export_html(notebook_path: str | Path, html_path: str | Path) -> Path:
    """Export an executed notebook to an HTML page that opens offline from disk.

    The page loads plotly.js from ``plotly.min.js`` in its own folder (written there once if missing)
    and no other script from anywhere.
    """
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    out = Path(html_path)
    nb = clean_outputs(nbformat.read(str(notebook_path), as_version=4))
    has_figures = any('class="plotly-graph-div"' in o.get("data", {}).get("text/html", "")
                      for c in nb.cells for o in c.get("outputs", []) if "data" in o)
    if has_figures:
        write_plotly_js(out.parent)
    exporter = HTMLExporter(
        template_name="lab", extra_loaders=[DictLoader({"eagle3lab_offline.html.j2": _TEMPLATE})]
    )
    exporter.template_file = "eagle3lab_offline.html.j2"
    exporter.exclude_input_prompt = False
    body, _ = exporter.from_notebook_node(
        nb, resources={"eagle3lab_plotly_js": PLOTLY_JS if has_figures else ""}
    )
    out.write_text(body, encoding="utf-8")
    return out


def external_scripts(html_text: str) -> list[str]:
    """The ``src`` of every script that is not a relative file path (must be empty for an offline report)."""
    srcs = re.findall(r"<script[^>]*\bsrc=[\"']([^\"']+)[\"']", html_text, flags=re.I)
    return [s for s in srcs if re.match(r"^([a-z][a-z0-9+.-]*:|//|/)", s, flags=re.I)]


def inline_plotly_js(html_text: str) -> bool:
    """True when a page carries the plotly.js library inline (it should load ``plotly.min.js`` instead)."""
    return "* plotly.js v" in html_text


def escape(text: Any) -> str:
    """HTML-escape any value (shared by the index and compare pages)."""
    return html.escape(str(text))
