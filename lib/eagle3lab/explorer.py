"""The acceptance explorer: pick a run, an aux-layer set, k, a prompt set and a prompt; see acceptance per
draft position (with 95% intervals over prompts) and the prompt's tokens coloured by what happened to them.

It reads the per-round records that 05_acceptance writes (``<run>/artifacts/acceptance/records.jsonl``,
format in DESIGN.md, "Acceptance records") and draws with acceptance's own figure and token view, so the
explorer and the static page never disagree.

In JupyterLab it is an ipywidgets panel. Its output also carries a static rendering of the first selection
(the figure and the token view), which is what the offline HTML export shows instead of a dead widget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lab import acceptance
from eagle3lab.report import WIDGET_MIME, figure_html, show

RECORDS = Path("artifacts") / "acceptance" / "records.jsonl"


@dataclass(frozen=True)
class Selection:
    """One choice in the explorer: which records, and which prompt's tokens to show."""

    run: str
    drafter: str
    k: int
    split: str
    temperature: float
    prompt_index: int


def find_runs(*folders: str | Path) -> list[Path]:
    """Run folders that hold acceptance records: each given folder that is a run, and the runs inside each
    given folder (e.g. ``outputs/``), newest name last."""
    found: list[Path] = []
    for f in map(Path, folders):
        candidates = [f] if (f / RECORDS).is_file() else sorted(p for p in f.glob("*") if (p / RECORDS).is_file())
        found.extend(c.resolve() for c in candidates if c.resolve() not in found)
    return found


def load_records(run: str | Path) -> list[dict[str, Any]]:
    """The records of one run (acceptance's reader)."""
    return acceptance.read_records(Path(run) / RECORDS)


def options(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The values each choice can take in these records (sorted; drafter "main" first)."""
    drafters = sorted({r["drafter"] for r in records}, key=lambda d: (d != "main", d))
    return {"drafter": drafters, "k": sorted({int(r["k"]) for r in records}),
            "split": sorted({r["split"] for r in records}),
            "temperature": sorted({float(r["temperature"]) for r in records})}


def select(records: list[dict[str, Any]], drafter: str, k: int, split: str, temperature: float) -> list[dict[str, Any]]:
    """The records of one configuration, by prompt index."""
    rows = [r for r in records if r["drafter"] == drafter and int(r["k"]) == int(k) and r["split"] == split
            and float(r["temperature"]) == float(temperature)]
    return sorted(rows, key=lambda r: r["prompt_index"])


def default_selection(run: Path, records: list[dict[str, Any]]) -> Selection:
    """The first view: 04's drafter at the most-recorded k, held-out prompts, temperature 0, first prompt."""
    o = options(records)
    drafter = o["drafter"][0]
    counts = {k: sum(1 for r in records if int(r["k"]) == k and r["drafter"] == drafter) for k in o["k"]}
    split = "heldout" if "heldout" in o["split"] else o["split"][0]
    temp = 0.0 if 0.0 in o["temperature"] else o["temperature"][0]
    k = max(counts, key=counts.get)
    rows = select(records, drafter, k, split, temp)
    return Selection(run.name, drafter, k, split, temp, rows[0]["prompt_index"] if rows else 0)


def view(records: list[dict[str, Any]], sel: Selection) -> tuple[Any | None, str]:
    """The figure (acceptance per position over the configuration's prompts) and the chosen prompt's token
    view as HTML; ``(None, message)`` when the run has no records for this choice."""
    rows = select(records, sel.drafter, sel.k, sel.split, sel.temperature)
    if not rows:
        return None, (f"<p>No records for drafter {sel.drafter}, k = {sel.k}, {sel.split} prompts, "
                      f"T = {sel.temperature:g} in {sel.run} (05 records some combinations only).</p>")
    per_prompt = [acceptance.stats_from_record(r) for r in rows]
    try:
        iv = acceptance.prompt_intervals(per_prompt, num_boot=500)
        fig = acceptance.rates_figure(iv, title=f"{sel.run}: drafter {sel.drafter}, k = {sel.k}, {sel.split}, "
                                                f"T = {sel.temperature:g}")
        fig.update_layout(height=420, title_font_size=13)
    except ValueError:  # no prompt had a draft (all outputs shorter than a round)
        fig = None
    chosen = next((r for r in rows if r["prompt_index"] == sel.prompt_index), rows[0])
    tau = acceptance.stats_from_record(chosen).mean_acceptance_length
    head = f"<p>prompt {chosen['prompt_index']}: tau = {tau:.2f} of a possible {sel.k + 1}</p>"
    return fig, head + acceptance.token_view_html(chosen)


def static_html(records: list[dict[str, Any]], sel: Selection) -> str:
    """What the export shows for the explorer: the view of ``sel`` as plain HTML (the page loads plotly.js)."""
    fig, tokens = view(records, sel)
    note = (f"<p><i>Acceptance explorer (interactive in JupyterLab); static view of run {sel.run}, drafter "
            f"{sel.drafter}, k = {sel.k}, {sel.split} prompts, T = {sel.temperature:g}.</i></p>")
    return note + (figure_html(fig, include_plotlyjs=False) if fig is not None else "") + tokens


class Explorer:
    """The ipywidgets panel. ``Explorer(["outputs/"]).show()`` in a notebook cell."""

    def __init__(self, *folders: str | Path) -> None:
        import ipywidgets as widgets

        self.runs = find_runs(*folders)
        if not self.runs:
            raise FileNotFoundError(f"no run with {RECORDS} under {', '.join(map(str, folders))}")
        self._records: dict[Path, list[dict[str, Any]]] = {}
        kw = {"style": {"description_width": "7em"}, "layout": widgets.Layout(width="24em")}  # room for "temperature"
        self.run = widgets.Dropdown(options=[(p.name, p) for p in self.runs], value=self.runs[-1], description="run",
                                    **kw)
        self.drafter = widgets.Dropdown(description="aux layers", **kw)
        self.k = widgets.Dropdown(description="k", **kw)
        self.split = widgets.Dropdown(description="prompts", **kw)
        self.temperature = widgets.Dropdown(description="temperature", **kw)
        self.prompt = widgets.Dropdown(description="prompt", **kw)
        self.out = widgets.Output()
        self._busy = False
        self._fill_choices()
        for w in (self.drafter, self.k, self.split, self.temperature, self.prompt):
            w.observe(self._changed, names="value")
        self.run.observe(self._run_changed, names="value")
        controls = widgets.VBox([widgets.HBox([self.run, self.drafter, self.k]),
                                 widgets.HBox([self.split, self.temperature, self.prompt])])
        self.widget = widgets.VBox([controls, self.out])
        self._draw()

    def records(self) -> list[dict[str, Any]]:
        """The selected run's records (read once)."""
        if self.run.value not in self._records:
            self._records[self.run.value] = load_records(self.run.value)
        return self._records[self.run.value]

    def selection(self) -> Selection:
        """What the controls select now."""
        return Selection(self.run.value.name, self.drafter.value, int(self.k.value), self.split.value,
                         float(self.temperature.value), int(self.prompt.value or 0))

    def _fill_choices(self) -> None:
        recs = self.records()
        o, first = options(recs), default_selection(self.run.value, recs)
        self._busy = True
        try:
            self.drafter.options, self.drafter.value = o["drafter"], first.drafter
            self.k.options, self.k.value = o["k"], first.k
            self.split.options, self.split.value = o["split"], first.split
            self.temperature.options, self.temperature.value = o["temperature"], first.temperature
            self._fill_prompts(first.prompt_index)
        finally:
            self._busy = False

    def _fill_prompts(self, keep: int | None = None) -> None:
        rows = select(self.records(), self.drafter.value, self.k.value, self.split.value, self.temperature.value)
        opts = [(f"{r['prompt_index']}: {r.get('prompt_text', '')[-40:]!r}", r["prompt_index"]) for r in rows]
        self.prompt.options = opts or [("(none)", 0)]
        values = [v for _, v in self.prompt.options]
        self.prompt.value = keep if keep in values else values[0]

    def _run_changed(self, _change: dict[str, Any]) -> None:
        self._fill_choices()
        self._draw()

    def _changed(self, change: dict[str, Any]) -> None:
        if self._busy:
            return
        if change["owner"] is not self.prompt:
            self._busy = True
            try:
                self._fill_prompts(self.prompt.value)
            finally:
                self._busy = False
        self._draw()

    def _draw(self) -> None:
        from IPython.display import HTML, display

        fig, tokens = view(self.records(), self.selection())
        self.out.clear_output(wait=True)
        with self.out:
            if fig is not None:
                show(fig)
            display(HTML(tokens))

    def show(self) -> None:
        """Display the panel; the output also carries the static view of the current selection (the export
        shows that, since a widget cannot run in an offline page)."""
        from IPython.display import display

        static = static_html(self.records(), self.selection())
        display({WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
                 "text/html": static, "text/plain": "acceptance explorer"}, raw=True)


def explore(*folders: str | Path) -> Explorer | None:
    """Show the explorer over the runs in ``folders`` (a run folder, or a folder of runs such as
    ``outputs/``); outside a live kernel with ipywidgets, show the static view of the newest run."""
    try:
        ex = Explorer(*folders)
    except ImportError:
        from IPython.display import HTML, display

        run = find_runs(*folders)[-1]
        recs = load_records(run)
        display(HTML(static_html(recs, default_selection(run, recs))))
        return None
    ex.show()
    return ex
