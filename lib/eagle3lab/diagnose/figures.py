"""Figures of a diagnosis: the Protocol members per level, and the registry at a glance."""

from __future__ import annotations

from typing import Any

from eagle3lab.diagnose.registry import STATUSES, RegistryRow, registry_counts
from eagle3lab.diagnose.verdict import Diagnosis


def interface_figure(diagnoses: list[Diagnosis], label: str) -> Any:
    """Heatmap: for every level of every diagnosis, which Protocol members it has, and whether its forward
    collects aux hidden states (green: present)."""
    import plotly.graph_objects as go

    members = diagnoses[0].protocol_members if diagnoses else []
    levels = [(d.info.architecture, lv) for d in diagnoses for lv in d.levels]
    cols = [*members, "forward collects aux"]
    z = [[int(m in lv.interface.members_present) for m in members] + [int(bool(lv.forward_collects_aux))]
         for _, lv in levels]
    names = [f"{arch} · {'  ' * lv.depth}{lv.class_name}" for arch, lv in levels]
    fig = go.Figure(go.Heatmap(
        z=z, x=cols, y=names, zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
        colorscale=[[0, "#e45756"], [1, "#54a24b"]],
        text=[["yes" if v else "no" for v in row] for row in z], texttemplate="%{text}",
    ))
    fig.update_layout(
        title=f"SupportsEagle3 members per level ({label})", height=140 + 40 * len(names),
        xaxis_title="member of the installed SupportsEagle3 Protocol", yaxis_title="architecture · level",
        yaxis_autorange="reversed", margin={"l": 20, "r": 20, "t": 60, "b": 20},
    )
    return fig


def members_before_after_figure(before: list[dict[str, Any]], after: list[dict[str, Any]], simulated: bool) -> Any:
    """Two stacked heatmaps (before and after the patch) of ``patch.interface_matrix`` rows: which Protocol
    members each class has, and whether vLLM's ``isinstance(SupportsEagle3)`` test passes (green: yes)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    members = after[0]["protocol_members"] if after else []
    columns = [*members, "isinstance(SupportsEagle3)"]
    # Stacked panels on one x axis: member names once, at the bottom; class names at the left of each panel
    # (side by side, the right panel's class names ran into the left panel).
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("before the patch" + (" (simulated legacy)" if simulated else ""),
                                        "after the patch"))
    for row, rows in ((1, before), (2, after)):
        z = [[int(m in r["members_present"]) for m in members] + [int(r["supports_eagle3"])] for r in rows]
        fig.add_trace(go.Heatmap(z=z, x=columns, y=[r["arch"] for r in rows], zmin=0, zmax=1, showscale=False,
                                 xgap=2, ygap=2, colorscale=[[0, "#d9534f"], [1, "#5cb85c"]],
                                 text=[["yes" if v else "no" for v in r] for r in z], texttemplate="%{text}",
                                 hovertemplate="%{y}<br>%{x}: %{text}<extra></extra>"), row=row, col=1)
    fig.update_xaxes(tickangle=-25, automargin=True)
    fig.update_yaxes(automargin=True)
    fig.update_layout(title="SupportsEagle3 members per class (green: present)", height=330 + 90 * len(after),
                      margin={"l": 20, "r": 20, "t": 90, "b": 20})
    return fig


def registry_figure(rows: list[RegistryRow], vllm_version: str) -> Any:
    """Stacked bars per registry kind: native / patchable / not patchable / not loadable (they partition the rows)."""
    import plotly.graph_objects as go

    counts = [c for c in registry_counts(rows) if c.kind != "all"]
    kinds = [c.kind for c in counts]
    colors = {"native": "#54a24b", "patchable": "#f58518", "not patchable": "#bab0ac", "not loadable here": "#e0e0e0"}
    field = {"native": "native", "patchable": "patchable", "not patchable": "not_patchable",
             "not loadable here": "not_loadable"}
    fig = go.Figure([
        go.Bar(name=s, x=kinds, y=[getattr(c, field[s]) for c in counts], marker_color=colors[s],
               text=[getattr(c, field[s]) for c in counts], textposition="inside")
        for s in STATUSES
    ])
    fig.update_layout(
        barmode="stack", height=380, title=f"EAGLE-3 support across vLLM {vllm_version}'s registry",
        xaxis_title="registered generative models, by kind", yaxis_title="architectures",
        legend_title_text="status",
    )
    return fig
