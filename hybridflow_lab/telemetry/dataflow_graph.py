"""The dataflow graph of a step, from its STAGE spans: the stages on the models that run them, and the columns
that flow between them with their sizes.

Each stage span says which model ran it, which columns it read and which it wrote (``StageRunner`` records
them), so any dataflow, a notebook's own included, is drawn from what it called. A stage that reads the
``WHOLE_BATCH`` gets one edge, from the stage that last wrote to the batch. Stages of the step running now
are ``done`` or ``running``; those the previous step ran and this one has not reached yet are ``waiting``.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybridflow_lab.telemetry.spans import Phase, Span
from hybridflow_lab.telemetry.summary import format_bytes

WHOLE_BATCH = "*"  # a stage's ``reads`` when it takes every column of its batch
MODEL_ROWS = ("rollout", "actor", "environment", "reference", "critic", "reward model", "reward function",
              "controller")
ENVIRONMENT = "environment"  # the node of a multi-turn rollout's environment, after the stage that generated
ENVIRONMENT_COLUMNS = ("turn_rewards", "tool_calls", "turns", "ended")  # what the environment decided
NOT_DATAFLOW = ("evaluate", "save")  # stages a run calls besides the algorithm's dataflow
THEMED_TEXT = "fill: var(--jp-ui-font-color1, #333)"  # text outside the boxes follows JupyterLab's theme
STATUS_COLOURS = {"done": "#cfe3f7", "running": "#ffb347", "waiting": "#eeeeee"}


@dataclass
class GraphNode:
    """One stage call of the step: ``key`` is its name, with ``#2``... for later calls of the same stage."""

    key: str
    stage: str
    model: str
    pool: str
    status: str  # done | running | waiting
    step: int | None = None
    seconds: float = 0.0
    moved_bytes: int = 0
    calls: int | None = None  # the environment's: tool calls made
    reads: list[str] = field(default_factory=list)
    writes: dict[str, dict[str, Any]] = field(default_factory=dict)  # column -> shape, dtype, bytes

    def label(self) -> str:
        if self.status == "running":
            return "running"
        if self.status == "waiting":
            return "waiting"
        moved = f" · {format_bytes(self.moved_bytes)}" if self.moved_bytes else ""
        calls = f"{self.calls} calls · " if self.calls is not None else ""
        return f"{calls}{self.seconds:.2f} s{moved}"


@dataclass
class GraphEdge:
    """``columns`` written by ``source`` and read by ``target``; ``bytes`` is their size."""

    source: str
    target: str
    columns: list[str]
    bytes: int

    def label(self, shown: int = 2) -> str:
        names = ", ".join(self.columns[:shown]) + (f" +{len(self.columns) - shown}" if len(self.columns) > shown
                                                    else "")
        return f"{names} · {format_bytes(self.bytes)}" if self.bytes else names


@dataclass(repr=False)
class DataflowGraph:
    """The stages of step ``step`` in the order they started, the columns between them, and the model rows drawn
    (those declared by the run and those its stages ran on). Displays as an SVG. ``step`` is the spans' 0-based
    index; it is shown as ``lab.history`` numbers steps (``step + 1``)."""

    step: int | None
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    models: list[str]
    empty_reason: str = ""

    def node(self, key: str) -> GraphNode:
        for node in self.nodes:
            if node.key == key:
                return node
        raise KeyError(f"no stage {key!r} in the graph of step {self.step + 1}; it has {[n.key for n in self.nodes]}")

    def running(self) -> list[str]:
        return [node.key for node in self.nodes if node.status == "running"]

    def __str__(self) -> str:
        if not self.nodes:
            return self.empty_reason
        lines = [f"dataflow of step {self.step + 1}:"]
        lines += [f"  {n.key} [{n.model}] {n.label()}" for n in self.nodes]
        lines += [f"  {e.source} -> {e.target}: {e.label(len(e.columns))}" for e in self.edges]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return to_svg(self)


def dataflow_graph(spans: Iterable[Span], running: Sequence[Span] = (), models: Sequence[str] = (),
                   step: int | None = None, current: int | None = None) -> DataflowGraph:
    """The graph of ``step`` (default: ``current``, the run's step, once a stage of it started; else the newest
    among ``spans``, finished STAGE spans, and ``running``, stages started and not ended), with the previous
    step's stages this one has not reached yet; ``models`` are rows drawn even before a stage runs on them (the
    run's declared models). Generation for a later step running ahead does not make that step the newest."""
    stages = [s for s in spans if _drawn(s)]
    active = [s for s in running if _drawn(s)]
    started = {s.step for s in [*stages, *active]}
    if not started:
        return DataflowGraph(None, [], [], _rows(models, []), "no stage has run yet: lab.step() (or a stage called "
                             "in a cell) draws the stages the algorithm calls")
    if step is None:
        step = current if current in started else max(s for s in started if current is None or s < current)
    steps = sorted(started | {step})
    nodes = _nodes([s for s in stages if s.step == step], [s for s in active if s.step == step])
    earlier = [s for s in steps if s < step]
    if earlier:
        seen = {n.key for n in nodes}
        nodes += [replace(n, status="waiting", seconds=0.0, moved_bytes=0)
                  for n in _nodes([s for s in stages if s.step == earlier[-1]]) if n.key not in seen]
    return DataflowGraph(step, nodes, _edges(nodes), _rows(models, nodes))


def _drawn(span: Span) -> bool:
    return span.phase is Phase.STAGE and "reads" in span.attrs and span.step is not None \
        and span.name not in NOT_DATAFLOW


def _nodes(finished: list[Span], running: Sequence[Span] = ()) -> list[GraphNode]:
    """A node per span, in the order they started; a stage called again in the step is ``<stage>#2``..."""
    counts: dict[str, int] = {}
    nodes = []
    calls = [(span, True) for span in finished] + [(span, False) for span in running]
    for span, done in sorted(calls, key=lambda call: call[0].t_start):
        counts[span.name] = counts.get(span.name, 0) + 1
        key = span.name if counts[span.name] == 1 else f"{span.name}#{counts[span.name]}"
        nodes.append(GraphNode(key, span.name, span.attrs.get("model", "controller"), span.attrs.get("pool", ""),
                               "done" if done else "running", span.step, span.duration if done else 0.0,
                               int(span.attrs.get("moved", 0)), reads=list(span.attrs.get("reads", [])),
                               writes=dict(span.attrs.get("writes", {})) if done else {}))
        if "environment" in span.attrs:
            nodes.append(_environment_node(nodes[-1], span.attrs["environment"]))
    return nodes


def _environment_node(generated: GraphNode, environment: dict[str, float]) -> GraphNode:
    """The environment that answered ``generated``'s turns: it read the responses and wrote the turn rewards and
    the columns counting calls and turns (taken from the generating node's writes)."""
    writes = {c: generated.writes.pop(c) for c in ENVIRONMENT_COLUMNS if c in generated.writes}
    key = ENVIRONMENT if generated.key == generated.stage else f"{ENVIRONMENT}{generated.key[len(generated.stage):]}"
    return GraphNode(key, ENVIRONMENT, ENVIRONMENT, "controller", generated.status, generated.step,
                     float(environment.get("seconds", 0.0)), calls=int(environment.get("calls", 0)),
                     reads=["responses"], writes=writes)


def _edges(nodes: list[GraphNode]) -> list[GraphEdge]:
    """Each read column from the latest earlier node that wrote it (a waiting node reads what its previous-step
    self read; a done node's writes feed the nodes after it)."""
    edges: dict[tuple[str, str], GraphEdge] = {}
    for index, node in enumerate(nodes):
        earlier = nodes[:index]
        for column in node.reads:
            source = next((n for n in reversed(earlier) if (n.writes if column == WHOLE_BATCH else column in n.writes)),
                          None)
            if source is None:
                continue
            size = sum(c["bytes"] for c in source.writes.values()) if column == WHOLE_BATCH \
                else source.writes[column]["bytes"]
            edge = edges.setdefault((source.key, node.key), GraphEdge(source.key, node.key, [], 0))
            edge.columns.append("batch" if column == WHOLE_BATCH else column)
            edge.bytes += size
    return list(edges.values())


def _rows(models: Sequence[str], nodes: list[GraphNode]) -> list[str]:
    used = set(models) | {n.model for n in nodes}
    return [m for m in MODEL_ROWS if m in used] + sorted(used - set(MODEL_ROWS))


def node_html(node: GraphNode, headline: str = "") -> str:
    """What a selected node shows: where it ran, its seconds and bytes, what it read and the columns it wrote."""
    rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{info['shape']}</td><td>{html.escape(info['dtype'])}</td>"
                   f"<td>{format_bytes(info['bytes'])}</td></tr>" for name, info in node.writes.items())
    reads = ", ".join("the whole batch" if r == WHOLE_BATCH else r for r in node.reads) or "nothing"
    return (f"<div class='hybridflow-node-detail'><b>{html.escape(node.key)}</b> on {html.escape(node.model)} "
            f"({html.escape(node.pool)}), {node.status}: {html.escape(node.label())}"
            + (f"<br>{html.escape(headline)}" if headline else "")
            + f"<br>read: {html.escape(reads)}<table><tr><th>column written</th><th>shape</th><th>dtype</th>"
            f"<th>size</th></tr>{rows}</table></div>")


# ---------------------------------------------------------------------------------------------------- drawing
COLUMN_W, ROW_H, BOX_W, BOX_H, LEFT = 150, 70, 124, 40, 120


def to_svg(graph: DataflowGraph, selected: str = "") -> str:
    """The graph as an SVG: a row per model, a box per stage call in the order they started (the running ones
    orange, those not reached yet grey), an arrow per edge labelled with its columns and bytes."""
    if not graph.nodes:
        return f"<p class='hybridflow-graph-empty'><i>{html.escape(graph.empty_reason)}</i></p>"
    row_of = {model: index for index, model in enumerate(graph.models)}
    where = {n.key: (LEFT + index * COLUMN_W, 30 + row_of[n.model] * ROW_H) for index, n in enumerate(graph.nodes)}
    width, height = LEFT + len(graph.nodes) * COLUMN_W, 40 + len(graph.models) * ROW_H
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' class='hybridflow-graph' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' style='max-width: 100%; height: auto' font-family='sans-serif' "
             "font-size='11'>",
             "<defs><marker id='hf-arrow' viewBox='0 0 10 10' refX='10' refY='5' markerWidth='7' markerHeight='7' "
             "orient='auto-start-reverse'><path d='M 0 0 L 10 5 L 0 10 z' fill='#555'/></marker></defs>",
             f"<text x='4' y='16' font-weight='bold' style='{THEMED_TEXT}'>step {graph.step + 1}</text>"]
    for model, index in row_of.items():
        y = 30 + index * ROW_H
        parts.append(f"<line x1='0' y1='{y + BOX_H + 14}' x2='{width}' y2='{y + BOX_H + 14}' stroke='#e4e4e4'/>"
                     f"<text x='4' y='{y + BOX_H / 2 + 4}' style='{THEMED_TEXT}'>{html.escape(model)}</text>")
    for edge in graph.edges:
        (x1, y1), (x2, y2) = where[edge.source], where[edge.target]
        start, end = (x1 + BOX_W, y1 + BOX_H / 2), (x2, y2 + BOX_H / 2)
        bend = (start[0] + end[0]) / 2
        parts.append(f"<path class='hybridflow-edge' d='M {start[0]} {start[1]} C {bend} {start[1]}, {bend} {end[1]}, "
                     f"{end[0]} {end[1]}' fill='none' stroke='#777' marker-end='url(#hf-arrow)'>"
                     f"<title>{html.escape(edge.label(len(edge.columns)))}</title></path>"
                     f"<text x='{bend}' y='{(start[1] + end[1]) / 2 - 3}' text-anchor='middle' font-size='9' "
                     f"style='{THEMED_TEXT}'>{html.escape(edge.label())}</text>")
    for node in graph.nodes:
        x, y = where[node.key]
        stroke, stroke_width = ("#d62728", 3) if node.key == selected else ("#4a6fa5", 1)
        columns = ", ".join(node.writes) or "-"
        parts.append(f"<g class='hybridflow-node' data-stage='{html.escape(node.key)}' "
                     f"data-status='{node.status}'><title>{html.escape(node.key)} on {html.escape(node.model)} "
                     f"({html.escape(node.pool)}): wrote {html.escape(columns)}</title>"
                     f"<rect x='{x}' y='{y}' width='{BOX_W}' height='{BOX_H}' rx='6' "
                     f"fill='{STATUS_COLOURS[node.status]}' stroke='{stroke}' stroke-width='{stroke_width}'/>"
                     f"<text x='{x + BOX_W / 2}' y='{y + 16}' text-anchor='middle' font-weight='bold' fill='#222'>"
                     f"{html.escape(node.key)}</text>"
                     f"<text x='{x + BOX_W / 2}' y='{y + 31}' text-anchor='middle' fill='#222'>"
                     f"{html.escape(node.label())}</text></g>")
    parts.append("</svg>")
    return "".join(parts)
