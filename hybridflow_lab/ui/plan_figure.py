"""Plotly pictures of the auto-mapping: ranked plans as a per-stage Gantt, and predicted against measured seconds.

``plan_gantt`` draws one row per ``MappingPlan``: its stages laid end to end (a pale bar per stage, as long as
the plan's stage seconds), and inside each stage a thin bar per colocated set. Sets that run side by side
start together, so the stage lasts as long as the slowest one; sets called one after another (the Lab) follow
each other. The controller's own seconds, if any, come last.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from hybridflow_lab.placement.automap import MappingPlan

CONTROLLER = "controller"
STAGE_COLORS = {"generation": qualitative.Plotly[0], "preparation": qualitative.Plotly[2],
                "training": qualitative.Plotly[1], CONTROLLER: "gray"}
ROW_HEIGHT = 0.8  # of a category's height on the plans axis
PREDICTED, MEASURED = "predicted", "last step (measured)"


def stage_color(stage: str, index: int) -> str:
    """The stage's colour; a stage without one takes the ``index``-th of the remaining palette."""
    return STAGE_COLORS.get(stage, qualitative.Plotly[(3 + index) % len(qualitative.Plotly)])


def plan_labels(plans: Sequence[MappingPlan]) -> list[str]:
    """Default row labels: rank and kind, e.g. ``#1 colocate``."""
    return [f"#{rank} {plan.kind}" for rank, plan in enumerate(plans, 1)]


def plan_gantt(plans: Sequence[MappingPlan], labels: Sequence[str] | None = None,
               title: str = "predicted seconds per iteration, by stage") -> go.Figure:
    """One row per plan (first plan on top). Trace ``<stage>`` holds the stage bars (``base`` = the stage's start,
    ``x`` = its seconds); trace ``<stage> by set`` one thin bar per colocated set; trace ``controller`` the rest."""
    labels = list(plan_labels(plans) if labels is None else labels)
    if len(labels) != len(plans) or len(set(labels)) != len(labels):
        raise ValueError(f"need {len(plans)} distinct labels, got {labels}")
    stages = list(dict.fromkeys(stage for plan in plans for stage in plan.stage_s))
    start = [0.0] * len(plans)
    figure = go.Figure()
    for index, stage in enumerate(stages):
        color, seconds = stage_color(stage, index), [plan.stage_s.get(stage, 0.0) for plan in plans]
        figure.add_trace(go.Bar(
            name=stage, orientation="h", y=labels, x=seconds, base=list(start), legendgroup=stage,
            marker={"color": color, "opacity": 0.3, "line": {"color": color, "width": 1}}, width=ROW_HEIGHT,
            customdata=[plan.describe() for plan in plans],
            hovertemplate=f"{stage}: %{{x:.3g}} s<br>%{{customdata}}<extra>%{{y}}</extra>"))
        bars: dict[str, list[Any]] = {"y": [], "x": [], "base": [], "offset": [], "width": [], "text": []}
        for row, plan in enumerate(plans):
            if stage not in plan.stage_s:
                continue
            in_turn, thickness = not plan.concurrent, ROW_HEIGHT / len(plan.sets)
            begin = start[row]
            for slot, colocated in enumerate(plan.sets):
                bars["y"].append(labels[row])
                bars["x"].append(colocated.stage_s(stage))
                bars["base"].append(begin)
                bars["offset"].append(-ROW_HEIGHT / 2 + slot * thickness)
                bars["width"].append(thickness * 0.9)
                bars["text"].append(colocated.describe())
                begin += colocated.stage_s(stage) if in_turn else 0.0
        figure.add_trace(go.Bar(
            name=f"{stage} by set", orientation="h", showlegend=False, legendgroup=stage, marker_color=color,
            customdata=bars.pop("text"), hovertemplate=f"{stage}: %{{x:.3g}} s<br>%{{customdata}}<extra></extra>",
            **bars))
        start = [begin + length for begin, length in zip(start, seconds, strict=True)]
    controller = [plan.controller_s for plan in plans]
    if any(controller):
        figure.add_trace(go.Bar(name=CONTROLLER, orientation="h", y=labels, x=controller, base=list(start),
                                marker_color=STAGE_COLORS[CONTROLLER], width=ROW_HEIGHT,
                                hovertemplate="controller: %{x:.3g} s<extra>%{y}</extra>"))
    figure.update_layout(barmode="overlay", title=title, xaxis_title="seconds", height=140 + 45 * len(plans),
                         yaxis={"autorange": "reversed"}, legend_title="stage",
                         margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return figure


def predicted_vs_measured(predicted: Mapping[str, float], measured: Mapping[str, float],
                          title: str = "seconds per step: simulator vs measured") -> go.Figure:
    """Grouped bars per stage (the predicted stages first, then any only measured); a missing value draws no bar."""
    stages = list(dict.fromkeys([*predicted, *measured]))
    figure = go.Figure([
        go.Bar(name=name, x=stages, y=[values.get(stage) for stage in stages], marker_color=color,
               text=[f"{values[stage]:.2f}" if stage in values else "" for stage in stages], textposition="outside")
        for name, values, color in (("predicted", predicted, qualitative.Plotly[0]),
                                    ("measured", measured, qualitative.Plotly[1]))])
    figure.update_layout(barmode="group", title=title, yaxis_title="seconds", height=380,
                         margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return figure


def predicted_beside_measured(prediction: MappingPlan, measured: Mapping[str, float] | None,
                              title: str = "this placement: predicted stages beside the last measured step"
                              ) -> go.Figure:
    """``plan_gantt`` of ``prediction`` (row ``predicted``) with a row of ``measured`` seconds per simulator stage
    (``placement.measured.stage_seconds``: its stages end to end, then the rest of the step as controller time)."""
    figure = plan_gantt([prediction], [PREDICTED], title)
    figure.update_layout(height=260, legend={"orientation": "h", "y": -0.3})
    if not measured:
        figure.add_annotation(text="no step measured yet: run lab.step()", showarrow=False, x=1, y=1.08,
                              xanchor="right", xref="paper", yref="paper", font={"color": "#888"})
        return figure
    start = 0.0
    stages = [stage for stage in prediction.stage_s if stage in measured]
    rest = max(0.0, measured.get("step", 0.0) - sum(measured[s] for s in stages))
    for index, (stage, seconds) in enumerate([*((s, measured[s]) for s in stages), (CONTROLLER, rest)]):
        figure.add_trace(go.Bar(name=f"{stage} (measured)", orientation="h", y=[MEASURED], x=[seconds], base=[start],
                                marker_color=STAGE_COLORS.get(stage, stage_color(stage, index)), width=ROW_HEIGHT,
                                showlegend=False, hovertemplate=f"{stage}: %{{x:.3g}} s measured<extra></extra>"))
        start += seconds
    return figure
