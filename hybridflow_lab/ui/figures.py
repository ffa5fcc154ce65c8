"""Plotly figures of a run, built from telemetry spans and per-step metrics (notebook and served dashboards)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hybridflow_lab.telemetry import Phase, Span, format_bytes

CONTROLLER_ROW = "controller"
TIMELINE_PHASES = (Phase.STAGE, Phase.EXECUTE, Phase.TRANSFER)
CURVES = (  # (title, metric keys drawn in that panel)
    ("score", ("critic/score/mean",)),
    ("accuracy", ("train/accuracy", "eval/accuracy")),
    ("KL to reference", ("actor/kl",)),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
    ("tokens/s", ("perf/throughput",)),
)
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
    figure.update_layout(title=title, barmode="stack", xaxis_title="step", yaxis_title="seconds", height=320,
                         margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return figure


def curves(history: Sequence[Mapping[str, Any]], title: str = "training curves") -> go.Figure:
    """Score, accuracy, KL, entropy, response length and throughput per step (panels without data stay empty)."""
    figure = make_subplots(rows=2, cols=3, subplot_titles=[name for name, _ in CURVES])
    for index, (_, keys) in enumerate(CURVES):
        for key in keys:
            points = [(m.get("step", i + 1), m[key]) for i, m in enumerate(history) if key in m]
            if points:
                xs, ys = zip(*points, strict=True)
                figure.add_trace(go.Scatter(x=xs, y=ys, name=key, mode="lines+markers"),
                                 row=index // 3 + 1, col=index % 3 + 1)
    figure.update_layout(title=title, height=520, margin={"l": 10, "r": 10, "t": 60, "b": 40},
                         legend={"font": {"size": 10}})
    return figure


def samples_html(rows: Sequence[Mapping[str, Any]], limit: int = 16) -> str:
    """An HTML table of sample rows (prompt, response, ground truth, score, advantage)."""
    if not rows:
        return "<p><i>no samples yet</i></p>"
    columns = [c for c in SAMPLE_COLUMNS if any(c in row for row in rows)]
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(row.get(c))}</td>" for c in columns) + "</tr>"
                   for row in rows[:limit])
    return f"<table class='hybridflow-samples'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape("" if value is None else str(value))
