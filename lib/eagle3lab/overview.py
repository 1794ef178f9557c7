"""The run's overview page (``index.html``): one line per step with its conclusion, the headline figures
grouped with units and context, one figure, and a banner for every caveat the notebooks recorded.

Everything here is read from the metrics the notebooks recorded (``Workbook.record``, ``conclude``,
``caveat``); nothing is computed from the artifacts, so the page always says what the notebooks said.
The metric names are those each notebook records and documents; the acceptance records' format is in
DESIGN.md ("Acceptance records").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3lab.acceptance import implied_cost_ratio
from eagle3lab.report import PLOTLY_JS, escape, figure_html
from eagle3lab.workbook import CAVEATS_KEY, CONCLUSION_KEY

FIGURE_MARK = 'class="plotly-graph-div"'  # present in a page that draws a figure (needs plotly.min.js)
WRAPPER = "KimiK25ForConditionalGeneration"  # the class vLLM checks for Kimi-K2.5


@dataclass
class Row:
    """One headline figure: what it is, its value with units, and what to compare it with."""

    label: str
    value: str
    context: str = ""


@dataclass
class Group:
    """Headline figures about one subject."""

    title: str
    rows: list[Row] = field(default_factory=list)

    def add(self, label: str, value: str | None, context: str = "") -> None:
        """Add a row unless its value is unknown (``None``)."""
        if value is not None:
            self.rows.append(Row(label, value, context))


def _implied_cost(m: Mapping[str, Any], tps: Mapping[str, Any]) -> str:
    """The engine's own draft cost, from the batch-1 figures, to set beside the transformers-timed c."""
    tau = (m.get("acceptance.decoded_stats") or {}).get("mean_acceptance_length") or m.get("acceptance.mean_acceptance_length")
    k = m.get("acceptance.k")
    if not (tau and k and tps.get("baseline") and tps.get("eagle3")):
        return ""
    c = implied_cost_ratio(tau, int(k), tps["baseline"], tps["eagle3"])
    return (f"; so one draft step costs the engine {num(c)} of a target step (c implied with the engine's tau "
            f"{num(tau)} over all decoded prompts), against c = {num(m.get('acceptance.cost_ratio'))} timed in "
            "transformers below")


def run_fact(value: Any) -> str:
    """One value of the run's facts as the index page shows it: lists space-separated, a resumption as when,
    where and which steps it ran, those pending or failed before, package versions as "name version" pairs
    (never a Python dict)."""
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return "; ".join(f"{x.get('at', '?')} on {x.get('host', '?')}: ran the steps not done before: "
                         + ", ".join(x.get("rerun") or ["-"])
                         for x in value)
    if isinstance(value, list):
        return " ".join(map(str, value)) or "-"
    if isinstance(value, dict):  # the package versions
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    return str(value)


def merged(metrics: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """All notebooks' metrics in one dict (without the per-notebook conclusion and caveats)."""
    out: dict[str, Any] = {}
    for m in metrics.values():
        out.update({k: v for k, v in m.items() if k not in (CONCLUSION_KEY, CAVEATS_KEY)})
    return out


# ----------------------------------------------------------------------------------------- formatting


def num(v: Any, digits: int = 3) -> str | None:
    """A number with ``digits`` significant digits (thousands separated); None stays None."""
    if v is None or isinstance(v, bool):
        return None if v is None else ("yes" if v else "no")
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def pct(v: Any) -> str | None:
    """A rate in [0, 1] as a percentage."""
    return None if v is None else f"{100 * float(v):.1f}%"


def seq(vs: Any, fmt: Any = num) -> str | None:
    """A list of numbers as ``a / b / c``."""
    if not vs:
        return None
    return " / ".join(fmt(v) or "-" for v in vs)


def yesno(v: Any) -> str | None:
    """A bool as yes/no."""
    return None if v is None else ("yes" if v else "no")


# ------------------------------------------------------------------------------------- the headline


def headline(m: Mapping[str, Any]) -> list[Group]:
    """The headline figures of a run, grouped, from its merged metrics (groups without data are dropped)."""
    k = m.get("acceptance.k")
    target = Group("Target model")
    if m.get("target.skipped"):
        target.add("checkpoint", str(m.get("target.path", "")), "a user checkpoint: nothing was trained here")
    target.add("parameters", num(m.get("target.params")),
               f"{num(m.get('target.active_params'))} active per token (routed experts)"
               if m.get("target.active_params") else "")
    if m.get("target.heldout_ppl") is not None:
        h = m.get("target.unigram_entropy")
        target.add("held-out perplexity", num(m["target.heldout_ppl"]),
                   f"a context-free unigram model scores {num(math.exp(h))}; lower is better" if h else "")
    if m.get("target.train_steps_done") is not None:
        target.add("training", f"{num(m['target.train_steps_done'])} steps, {num(m.get('target.train_seconds'))} s",
                   f"{num(m['target.num_layers'])} layers" if m.get("target.num_layers") else "")

    vllm = Group("vLLM: refusal and patch")
    if m.get("diagnose.vllm_version"):
        sim = m.get("diagnose.legacy_simulated") or m.get("patch.legacy_simulation")
        vllm.add("vLLM", str(m["diagnose.vllm_version"]),
                 "LEGACY SIMULATION: this vLLM supports EAGLE-3 natively; its support was removed in-process so the "
                 "0.15-0.17 refusal could be reproduced, diagnosed and patched" if sim else "as installed")
    vllm.add(f"verdict for {WRAPPER}", m.get(f"diagnose.{WRAPPER}.verdict"),
             "native: accepted as is; patchable: our patch makes it acceptable; unsupported: neither")
    vllm.add(f"verdict for the target ({m.get('diagnose.target.architecture', '?')})", m.get("diagnose.target.verdict"))
    before, after = m.get(f"patch.before.{WRAPPER}.supports_eagle3"), m.get(f"patch.after.{WRAPPER}.supports_eagle3")
    if before is not None or after is not None:
        vllm.add(f"supports_eagle3({WRAPPER})", f"{yesno(before)} before the patch, {yesno(after)} after",
                 "the class vLLM's model runner checks; 'no' is the refusal")
    arch = m.get("diagnose.target.architecture")
    if arch and arch != WRAPPER and m.get(f"patch.before.{arch}.supports_eagle3") is not None:  # patch.architectures
        vllm.add(f"supports_eagle3({arch})", f"{yesno(m[f'patch.before.{arch}.supports_eagle3'])} before the patch, "
                 f"{yesno(m.get(f'patch.after.{arch}.supports_eagle3'))} after",
                 "the target's class as vLLM's model runner checks it; 'no' is the refusal")
    vllm.add("refusal raised at", m.get("diagnose.raise_site"))
    if m.get("patch.engine.served_with_patch") is not None:  # 02 launched a real vLLM engine (GPU profiles)
        refused = m.get("patch.engine.refused_without_patch")
        vllm.add("real vLLM engine", f"{'refused' if refused else 'started'} without the patch, "
                 f"{'served' if m['patch.engine.served_with_patch'] else 'FAILED'} with it",
                 f"MEASURED in fresh engine processes; {len(m.get('patch.engine.workers') or [])} worker(s) "
                 f"reported the patched classes. Refusal"
                 + {True: " (legacy simulation)", False: " (the installed vLLM's own, no simulation)"}.get(
                     m.get("patch.engine.refusal_simulated"), "")
                 + f": {m.get('patch.engine.refusal_message') or '-'}")

    data = Group("Data and aux hidden states")
    if m.get("data.num_samples") is not None:
        data.add("training samples", num(m["data.num_samples"]),
                 f"{num(m.get('data.response_tokens'))} response tokens" if m.get("data.response_tokens") else "")
    data.add("aux layer ids (vLLM)", seq(m.get("hidden.aux_layer_ids")),
             "id k = the residual stream at the input of layer k")
    if m.get("hidden.tokens_per_s") is not None:
        data.add("extraction", f"{num(m['hidden.tokens_per_s'])} tokens/s",
                 f"{num(m.get('hidden.bytes_per_token'))} bytes per token on disk")
    data.add("distinct 4-grams (generated held-out text)", pct(m.get("acceptance.eval_distinct_4gram")),
             f"training text: {pct(m.get('acceptance.train_distinct_4gram'))}"
             if m.get("acceptance.train_distinct_4gram") is not None else "")
    data.add("longest loop (median over prompts)",
             None if m.get("acceptance.eval_longest_loop") is None else f"{num(m['acceptance.eval_longest_loop'])} tokens",
             "a repeated run of tokens in the target's own continuations")

    drafter = Group("Drafter training")
    drafter.add("trainable parameters", num(m.get("drafter.params")))
    accs = [m[f"train.acc_pos{i}"] for i in range(1, 16) if f"train.acc_pos{i}" in m]
    drafter.add("training accuracy per draft position", seq(accs, pct) if accs else None,
                "next-next-token accuracy on the training data (TTT steps), not acceptance")
    if m.get("train.final_loss") is not None:
        drafter.add("final loss", num(m["train.final_loss"]),
                    f"{num(m.get('train.steps'))} steps in {num(m.get('train.seconds'))} s")

    acc = Group("Acceptance (held-out prompts)")
    tau = m.get("acceptance.mean_acceptance_length")
    if tau is not None:
        ci = m.get("acceptance.tau_ci95")
        acc.add("mean acceptance length tau (T=0)", f"{num(tau)} of a possible {k + 1}" if k else num(tau),
                (f"95% interval over prompts {num(ci[0])} - {num(ci[1])}; " if ci else "")
                + f"tokens per target forward at k = {k} drafts per round")
    acc.add("conditional acceptance per position", seq(m.get("acceptance.conditional_rate"), pct),
            "P(draft i accepted | drafts 1..i-1 accepted)")
    cum = m.get("acceptance.cumulative_rate") or m.get("acceptance.per_position_rate")
    acc.add("cumulative acceptance per position", seq(cum, pct),
            "accepted at i / rounds (vLLM's per-position rate; falls with i by construction)")
    acc.add("draft acceptance rate", pct(m.get("acceptance.draft_acceptance_rate")), "accepted / drafted tokens")
    acc.add("outputs equal greedy decoding", yesno(m.get("acceptance.outputs_match_greedy")),
            _greedy_context(m))
    acc.add("tau at temperature 1", num(m.get("acceptance.tau_t1")), "rejection sampling")
    if m.get("acceptance.humaneval_tau") is not None:
        acc.add("tau on HumanEval prompts", num(m["acceptance.humaneval_tau"]),
                f"{num(m.get('acceptance.humaneval_prompts'))} prompts nobody here wrote")
    acc.add("tau of an n-gram copy drafter", num(m.get("acceptance.ngram_tau")),
            "repetition baseline: what copying earlier text alone achieves")
    tbk = m.get("acceptance.tau_by_k")
    if tbk:
        acc.add("tau by k", ", ".join(f"k={kk}: {num(v)}" for kk, v in sorted(tbk.items(), key=lambda x: int(x[0]))),
                "same drafter; the ceiling is k + 1")

    speed = Group("Speedup")
    if m.get("acceptance.measured_speedup") is not None:
        n = m.get("acceptance.decoded_prompts")
        speed.add("measured speedup", f"{num(m['acceptance.measured_speedup'])}x",
                  "MEASURED on a real engine: wall time without over with EAGLE-3, warm engines (start excluded), "
                  + (f"the same {n} prompts decoded at once" if n else "the same prompts decoded at once")
                  + ("; at large batches on a small target the drafter's overhead outweighs what it saves (batch 1 "
                     "on a deeper target: benchmarks/gpu)" if m["acceptance.measured_speedup"] < 1 else ""))
    if m.get("acceptance.measured_speedup_batch1") is not None:
        tps = m.get("acceptance.batch1_tokens_per_s") or {}
        speed.add("measured speedup, batch 1", f"{num(m['acceptance.measured_speedup_batch1'])}x",
                  f"MEASURED: output tokens/s one prompt at a time, {m.get('acceptance.batch1_prompts')} prompts, warm "
                  f"engines: {num(tps.get('eagle3'))} with EAGLE-3 against {num(tps.get('baseline'))} without"
                  + _implied_cost(m, tps))
    if m.get("acceptance.modelled_speedup") is not None:
        speed.add("modelled speedup", f"{num(m['acceptance.modelled_speedup'])}x",
                  f"MODELLED: tau / (1 + k * c) with c = {num(m.get('acceptance.cost_ratio'))}, the measured "
                  "drafter/target forward-cost ratio; not a wall-clock measurement")
    if speed.rows and m.get("acceptance.measured_speedup") is None:
        speed.add("measured speedup", "not measured", "the reference decoder's wall time says nothing about an engine's")

    layers = Group("Per target layer")
    abl = m.get("acceptance.ablation")
    if abl:
        best, tied = m.get("acceptance.ablation_best"), m.get("acceptance.ablation_tied_with_best")
        if best and tied:  # within the noise: the ranking is not a result (a run before 2026-12-07 lacks the key)
            best = f"none resolved ({best} leads, its 95% interval overlapping {len(tied)} other set(s))"
        layers.add("tau per aux-layer set", ", ".join(f"{lab}: {num(v)}" for lab, v in abl.items()),
                   f"best: {best}; drafters trained with the same reduced budget" if best else "")
    elif m.get("acceptance.layer_sweep"):
        sweep = m["acceptance.layer_sweep"]
        layers.add("tau per aux-layer set", ", ".join(f"{lab}: {num(s.get('mean_acceptance_length'))}"
                                                      for lab, s in sweep.items()))
    probe = m.get("acceptance.probe_top1")
    if probe:
        layers.add("probe top-1 per layer", ", ".join(f"{i}: {pct(v)}" for i, v in sorted(probe.items(), key=lambda x: int(x[0]))),
                   f"how well each layer alone predicts the next token; best below the top: layer "
                   f"{m.get('acceptance.probe_best_layer')}")
    return [g for g in (target, vllm, data, drafter, acc, speed, layers) if g.rows]


def _greedy_context(m: Mapping[str, Any]) -> str:
    """Why speculative outputs may differ from greedy ones, with the run's own divergence figures."""
    base = "speculative decoding must not change the output"
    dv, n = m.get("acceptance.divergence"), m.get("acceptance.mismatching_prompts")
    if m.get("acceptance.outputs_match_greedy") is not False or not n:
        return base
    text = f"{n} of {num(m.get('acceptance.decoded_prompts'))} prompts differ"
    first = m.get("acceptance.first_divergence") or {}
    if first:
        text += f", first at token {min(first.values())} or later"
    if not (dv and dv.get("differing_at_a_token")):
        return text
    err = dv.get("precision_error")
    if err:
        return text + (f"; {dv['within_measured_error']} of {dv['differing_at_a_token']} part where the float32 margin "
                       f"is within what {err['dtype']} rounding of this target was measured to move a margin by at "
                       f"{dv['yardstick_share']:.2%} of positions ({dv['yardstick']:.3f}; its argmax leaves "
                       f"float32's at {err['argmax_flip_rate']:.2%} of positions)")
    return text + (f"; {dv['near_ties']} of {dv['differing_at_a_token']} part where the float32 target's two candidates "
                   f"lie within {num(dv['ties_within_bf16_steps'])} bf16 steps (a tie bf16 cannot resolve, not a "
                   "broken path)")


# ---------------------------------------------------------------------------------- step conclusions


def conclusion(step: str, m: Mapping[str, Any]) -> str:
    """A one-line conclusion for a step from the merged metrics (used when the notebook gave none)."""
    nb = step.split("_", 1)[-1]
    if nb == "target":
        if m.get("target.skipped"):
            return f"Uses the checkpoint {m.get('target.path', '')}."
        if m.get("target.heldout_ppl") is None:
            return ""
        return (f"Trained a {num(m.get('target.params'))}-parameter target for {num(m.get('target.train_steps_done'))} "
                f"steps: held-out perplexity {num(m['target.heldout_ppl'])}.")
    if nb == "diagnose" and m.get("diagnose.vllm_version"):
        sim = " (legacy 0.15-0.17 state simulated)" if m.get("diagnose.legacy_simulated") else ""
        kimi = m.get(f"diagnose.{WRAPPER}.verdict")
        return (f"vLLM {m['diagnose.vllm_version']}{sim}: {m.get('diagnose.target.architecture', 'target')} is "
                f"{m.get('diagnose.target.verdict', '?')}" + (f", {WRAPPER} is {kimi}" if kimi else "") + ".")
    if nb == "patch" and m.get("patch.verdict"):
        b, a = m.get(f"patch.before.{WRAPPER}.supports_eagle3"), m.get(f"patch.after.{WRAPPER}.supports_eagle3")
        lifted = f"supports_eagle3({WRAPPER}) {yesno(b)} -> {yesno(a)}; " if a is not None else ""
        return f"{lifted}verdict: {m['patch.verdict']}."
    if nb == "engine" and m.get("data.num_samples") is not None:
        return (f"{num(m['data.num_samples'])} samples generated; aux states at vLLM ids "
                f"{seq(m.get('hidden.aux_layer_ids'))} checked against a hand computation.")
    if nb == "train_drafter" and m.get("train.steps") is not None:
        accs = [m[f"train.acc_pos{i}"] for i in range(1, 16) if f"train.acc_pos{i}" in m]
        return (f"Drafter trained for {num(m['train.steps'])} steps; training accuracy per draft position "
                f"{seq(accs, pct)}.")
    if nb == "acceptance" and m.get("acceptance.mean_acceptance_length") is not None:
        k = m.get("acceptance.k")
        cond = m.get("acceptance.conditional_rate")
        return (f"tau = {num(m['acceptance.mean_acceptance_length'])} of a possible {k + 1 if k else '?'} at k = {k}"
                + (f"; conditional acceptance {seq(cond, pct)}" if cond else "")
                + (f"; outputs equal greedy: {yesno(m['acceptance.outputs_match_greedy'])}"
                   if m.get("acceptance.outputs_match_greedy") is not None else "") + ".")
    return ""


def caveats(metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every caveat the notebooks recorded, plus acceptance's degenerate-data flag."""
    out: list[str] = []
    for m in metrics.values():
        out.extend(str(c) for c in m.get(CAVEATS_KEY, []) if str(c) not in out)
    mm = merged(metrics)
    if mm.get("acceptance.degenerate"):
        reason = mm.get("acceptance.degenerate_reason") or "tau is inflated by repetition in the generated text."
        text = f"Degenerate data: {reason}"
        if not any(reason in c for c in out):
            out.append(text)
    return out


# ------------------------------------------------------------------------------------------ the page


def acceptance_figure(m: Mapping[str, Any]) -> Any | None:
    """The overview's one figure: acceptance per draft position, conditional and cumulative."""
    import plotly.graph_objects as go

    cum = m.get("acceptance.cumulative_rate") or m.get("acceptance.per_position_rate")
    cond = m.get("acceptance.conditional_rate")
    if not cum and not cond:
        return None
    fig = go.Figure()
    if cond:
        fig.add_bar(x=list(range(1, len(cond) + 1)), y=cond, name="conditional (given the earlier drafts accepted)")
    if cum:
        fig.add_bar(x=list(range(1, len(cum) + 1)), y=cum, name="cumulative (accepted at i / rounds)")
    tau, k = m.get("acceptance.mean_acceptance_length"), m.get("acceptance.k")
    title = "Acceptance per draft position" + (f" (tau = {num(tau)} of {k + 1})" if tau is not None and k else "")
    fig.update_layout(title=title, xaxis_title="draft position", yaxis_title="acceptance rate", yaxis_range=[0, 1],
                      xaxis_dtick=1, barmode="group", height=380, legend=dict(orientation="h", y=-0.25), showlegend=True,
                      margin=dict(l=60, r=20, t=50, b=90))
    return fig


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#1f2328}
table{border-collapse:collapse;margin-bottom:1.2em;width:100%}td,th{border:1px solid #d0d7de;padding:.35em .7em;
text-align:left;vertical-align:top}th{background:#f6f8fa}.err{color:#cf222e;white-space:pre-wrap;font-family:monospace}
.caveat{background:#fff8c5;border:1px solid #d4a72c;padding:.7em 1em;margin:1em 0;border-radius:6px}
.failed{background:#ffebe9;border:1px solid #cf222e}.ctx{color:#59636e;font-size:.92em}
.groups table td:nth-child(1){width:28%}.groups table td:nth-child(2){width:27%}
td{overflow-wrap:anywhere}td.step{white-space:nowrap;overflow-wrap:normal}h3{margin:.8em 0 .3em}.val{font-weight:600}"""

_STATUS_COLOR = {"ok": "#1a7f37", "failed": "#cf222e", "skipped": "#6e7781"}


def groups_html(groups: Iterable[Group]) -> str:
    """The headline groups as small tables."""
    e = escape
    parts = []
    for g in groups:
        rows = "".join(f"<tr><td>{e(r.label)}</td><td class='val'>{e(r.value)}</td>"
                       f"<td class='ctx'>{e(r.context)}</td></tr>" for r in g.rows)
        parts.append(f"<div><h3>{e(g.title)}</h3><table>{rows}</table></div>")
    return f"<div class='groups'>{''.join(parts)}</div>"  # stacked: long class names need the width


def page(title: str, body: str, with_plotly: bool) -> str:
    """A complete offline page; loads ``plotly.min.js`` from its own folder when it draws figures."""
    script = f'<script src="{PLOTLY_JS}"></script>' if with_plotly else ""
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{escape(title)}</title>{script}'
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")


def index_html(
    title: str,
    steps: Iterable[Mapping[str, Any]],
    metrics: Mapping[str, Mapping[str, Any]],
    info: Mapping[str, Any],
    files: Iterable[str] = ("metrics.json", "run.log", "params.yaml"),
) -> str:
    """The run's index page from its steps, the per-notebook metrics, the run facts and the run folder's
    other files worth a link (relative paths)."""
    e = escape
    m = merged(metrics)
    steps = list(steps)
    banners = [f"<div class='caveat'>&#9888; {e(c)}</div>" for c in caveats(metrics)]
    failed = [s["name"] for s in steps if s["status"] == "failed"]
    if failed:
        banners.insert(0, f"<div class='caveat failed'>The run failed at {e(failed[0])}: later steps were skipped "
                          "and the figures below are incomplete.</div>")
    rows = []
    for s in steps:
        color = _STATUS_COLOR.get(s["status"], "#000")
        links = " &middot; ".join(f'<a href="{e(s[key])}">{label}</a>'
                                  for key, label in (("html", "report"), ("ipynb", "notebook")) if s.get(key))
        said = (metrics.get(s["name"]) or {}).get(CONCLUSION_KEY) or conclusion(s["name"], m)
        said_html = f"<div class='err'>{e(s['error'])}</div>" if s.get("error") else e(said)
        rows.append(f"<tr><td class='step'>{e(s['name'])}</td><td style='color:{color};font-weight:600'>{e(s['status'])}</td>"
                    f"<td>{s.get('seconds', 0):.0f} s</td><td>{said_html}</td><td>{links}</td></tr>")
    groups = headline(m)
    fig = acceptance_figure(m)
    fig_html = figure_html(fig, include_plotlyjs=False) if fig is not None else ""
    facts = "".join(f"<tr><td>{e(k)}</td><td>{e(run_fact(v))}</td></tr>" for k, v in info.items())
    body = f"""<h1>{e(title)}</h1>
{''.join(banners)}
<h2>Steps</h2><table><tr><th>step</th><th>status</th><th>time</th><th>conclusion</th><th>pages</th></tr>
{''.join(rows)}</table>
<h2>Headline figures</h2>{groups_html(groups) if groups else '<p>none recorded</p>'}
{fig_html}
<h2>Run</h2><table>{facts}</table>
<p>{' &middot; '.join(f'<a href="{e(f)}">{e(f)}</a>' for f in files)}</p>"""
    return page(title, body, with_plotly=bool(fig_html))
