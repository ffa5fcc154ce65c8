"""Plotly figures of a run, built from telemetry spans and per-step metrics (notebook and served dashboards)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from hybridflow_lab.telemetry import Phase, Span, format_bytes
from hybridflow_lab.telemetry.trajectory_view import trajectory_html

CONTROLLER_ROW = "controller"
TIMELINE_PHASES = (Phase.STAGE, Phase.EXECUTE, Phase.TRANSFER)
CURVES = (  # (title, metric keys drawn in that panel, why a run that has steps has none of them)
    ("score", ("critic/score/mean",), "no scores logged"),
    ("accuracy", ("train/accuracy", "eval/accuracy"), "no accuracy logged"),
    ("KL to reference", ("actor/kl",), "no KL term in this run<br>(algorithm.kl_loss_coef,<br>kl_reward_coef)"),
    ("entropy", ("actor/entropy",), "no actor update logged"),
    ("response length", ("response_length/mean",), "no response lengths logged"),
    ("tokens/s", ("perf/throughput",), "no throughput logged"),
    ("clip fraction", ("actor/pg_clipfrac",), "no actor update logged"),
    ("gradient norm", ("actor/grad_norm",), "no actor update logged"),
    ("value loss", ("critic/vf_loss",), "no critic in this algorithm"),
)
NO_STEPS = "no step has run yet"
EVAL_PREFIX = "eval/"
MOVING_AVERAGE = 10  # steps in the curves' moving average
SAMPLE_COLUMNS = ("step", "prompt", "response", "ground_truth", "score", "advantage")


def timeline_row(span: Span) -> str:
    """The Gantt row of a span: the controller for stages (one row per lane when they overlapped), ``<group>
    r<rank>`` for a rank's work."""
    if span.phase is Phase.STAGE:
        lane = span.attrs.get("lane")
        return f"{CONTROLLER_ROW} ({lane})" if lane else CONTROLLER_ROW
    group = span.group.rsplit(".", 1)[-1] or span.role or "group"
    return f"{group} r{span.rank}"


def recent_steps(spans: Iterable[Span], steps: int) -> list[Span]:
    """The timeline's spans from the start of the last ``steps`` steps to the end, in time order.

    Walking back in time (rather than filtering by step number) keeps an earlier run in the same
    run directory, whose step numbers repeat, out of the window. Steps overlap when generation runs
    ahead (``rollout.max_staleness``): the window's edges are stages (the workers' spans of a weight
    load left running by the step before do not end it), and a later step's stage met on the way (its
    responses, generated ahead) neither counts nor ends it.
    """
    chosen = sorted((s for s in spans if s.phase in TIMELINE_PHASES), key=lambda s: s.t_start)
    edges = {Phase.STAGE} if any(s.phase is Phase.STAGE for s in chosen) else TIMELINE_PHASES
    seen: set[int] = set()
    first = len(chosen)
    for index in range(len(chosen) - 1, -1, -1):
        step = chosen[index].step
        if step is None or chosen[index].phase not in edges or (seen and step > max(seen)):
            continue  # drawn when it lies between the edges
        if step not in seen:
            if len(seen) == steps:
                break
            seen.add(step)
        first = index
    return chosen[first:]


def timeline(spans: Sequence[Span], title: str = "per-worker timeline") -> go.Figure:
    """A Gantt chart: one row per role rank (and the controller), one bar per span, coloured by name.

    Transfers (data between groups, hybrid-engine resharding) are hatched and labelled with their bytes.
    """
    figure = go.Figure()
    origin = min((s.t_start for s in spans), default=0.0)
    by_name: dict[tuple[str, bool], list[Span]] = {}
    for span in spans:
        by_name.setdefault((span.name, span.phase is Phase.TRANSFER), []).append(span)
    for (name, transfer), group in sorted(by_name.items()):
        figure.add_trace(go.Bar(
            orientation="h", name=f"{name} (transfer)" if transfer else name,
            y=[timeline_row(s) for s in group], base=[s.t_start - origin for s in group],
            x=[s.duration for s in group],
            text=[format_bytes(s.bytes_moved) if transfer else "" for s in group],
            hovertext=[_hover(s) for s in group], hoverinfo="text",
            marker_pattern_shape="/" if transfer else "",
        ))
    rows = sorted({timeline_row(s) for s in spans}, key=lambda r: (not r.startswith(CONTROLLER_ROW), r))
    if not spans:
        return empty(figure, title, "no spans yet: a stage called in a cell, or lab.step(), records them")
    figure.update_layout(title=title, barmode="overlay", xaxis_title="seconds", height=120 + 28 * len(rows),
                         yaxis={"categoryorder": "array", "categoryarray": rows[::-1]},
                         margin={"l": 10, "r": 10, "t": 40, "b": 40}, legend={"font": {"size": 10}})
    return figure


def _hover(span: Span) -> str:
    parts = [f"<b>{html.escape(span.name)}</b> ({span.phase.value})", f"step {span.step}",
             f"{span.duration * 1e3:.1f} ms"]
    if span.bytes_moved:
        parts.append(format_bytes(span.bytes_moved))
    parts += [f"{k}: {v}" for k, v in span.attrs.items()]
    return "<br>".join(parts)


def stage_times(history: Sequence[Mapping[str, Any]], title: str = "stage seconds per step") -> go.Figure:
    """Stacked bars: each step's ``timing_s/<stage>`` metrics."""
    stages = sorted({k for metrics in history for k in metrics if k.startswith("timing_s/") and k != "timing_s/step"})
    steps = [metrics.get("step", index + 1) for index, metrics in enumerate(history)]
    figure = go.Figure([go.Bar(name=key.removeprefix("timing_s/"), x=steps, y=[m.get(key, 0.0) for m in history])
                        for key in stages])
    if not history:
        return empty(figure, title, NO_STEPS)
    figure.update_layout(title=title, barmode="stack", xaxis_title="step", yaxis_title="seconds", height=320,
                         margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return figure


def empty(figure: go.Figure, title: str, why: str) -> go.Figure:
    """``figure`` with no axes and a note saying why it has nothing to draw."""
    figure.update_layout(title=title, height=140, xaxis={"visible": False}, yaxis={"visible": False},
                         margin={"l": 10, "r": 10, "t": 40, "b": 10})
    figure.add_annotation(text=why, showarrow=False, font={"size": 11, "color": "#888"}, xref="paper",
                          yref="paper", x=0.5, y=0.5)
    return figure


def curves(history: Sequence[Mapping[str, Any]], title: str = "training curves") -> go.Figure:
    """Score, accuracy, KL, entropy, response length, throughput, clip fraction, gradient norm and value loss per
    step; see ``run_curves``."""
    return run_curves({"": history}, title)


def run_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "training curves") -> go.Figure:
    """The curves of one or more runs (``label -> history``) on the same panels: each metric's raw values (faint)
    and their moving average over ``MOVING_AVERAGE`` steps, evaluations as markers only. A panel no run has
    data for says why."""
    rows = -(-len(CURVES) // 3)
    figure = make_subplots(rows=rows, cols=3, subplot_titles=[name for name, _, _ in CURVES])
    colours = qualitative.Plotly
    for index, (_, keys, why_empty) in enumerate(CURVES):
        where = {"row": index // 3 + 1, "col": index % 3 + 1}
        drawn = False
        for number, (label, history) in enumerate(runs.items()):
            for key_number, key in enumerate(keys):
                points = [(m.get("step", i + 1), m[key]) for i, m in enumerate(history) if key in m]
                if not points:
                    continue
                drawn = True
                xs, ys = zip(*points, strict=True)
                name = f"{label}: {key}" if label else key
                colour = colours[(number if len(runs) > 1 else key_number) % len(colours)]  # a colour per run
                if key.startswith(EVAL_PREFIX):
                    figure.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="markers", marker={"symbol": "diamond",
                                                "size": 9, "color": colour}), **where)
                    continue
                figure.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines+markers", opacity=0.35,
                                            line={"color": colour}, marker={"size": 4}, legendgroup=name,
                                            showlegend=False), **where)
                figure.add_trace(go.Scatter(x=xs, y=moving_average(ys, MOVING_AVERAGE), mode="lines",
                                            name=f"{name} (mean of {MOVING_AVERAGE})", line={"color": colour},
                                            legendgroup=name), **where)
        if not drawn:
            # an empty subplot draws no axes to refer to: place the note by the subplot's domain on the page
            axis = "" if index == 0 else str(index + 1)
            x_domain, y_domain = figure.layout[f"xaxis{axis}"].domain, figure.layout[f"yaxis{axis}"].domain
            figure.add_annotation(text=why_empty if any(runs.values()) else NO_STEPS, showarrow=False,
                                  font={"size": 10, "color": "#888"}, xref="paper", yref="paper",
                                  x=sum(x_domain) / 2, y=sum(y_domain) / 2)
    figure.update_layout(title=title, height=260 * rows, margin={"l": 10, "r": 10, "t": 60, "b": 40},
                         legend={"font": {"size": 10}})
    return figure


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Each value's mean with up to ``window - 1`` values before it."""
    return [sum(values[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def samples_html(rows: Sequence[Mapping[str, Any]], limit: int = 16) -> str:
    """An HTML table of sample rows (prompt, response, ground truth, score, advantage); a multi-turn row's
    response shows its turns, observations marked as not trained on."""
    if not rows:
        return "<p><i>no samples yet</i></p>"
    columns = [c for c in SAMPLE_COLUMNS if any(c in row for row in rows)]
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_sample_cell(row, c)}</td>" for c in columns) + "</tr>"
                   for row in rows[:limit])
    return f"<table class='hybridflow-samples'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _sample_cell(row: Mapping[str, Any], column: str) -> str:
    """A multi-turn row's response is its trajectory, turn by turn."""
    if column == "response" and row.get("trajectory"):
        return trajectory_html(row["trajectory"])
    return _cell(row.get(column))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape("" if value is None else str(value))
