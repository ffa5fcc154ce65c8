"""``dashboard(lab)``: a live notebook view of a Lab (dataflow graph, timeline, stage times, curves, samples).

Spans arrive through a telemetry subscription (a list append on the training thread); a
background thread redraws at most once per ``interval_s``, so the hot path never builds figures.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from hybridflow_lab.telemetry import DataflowGraph, Span, dataflow_graph
from hybridflow_lab.telemetry.dataflow_graph import node_html, to_svg
from hybridflow_lab.ui import figures
from hybridflow_lab.ui.live_figure import LiveFigure
from hybridflow_lab.ui.theme import themed

if TYPE_CHECKING:
    from hybridflow_lab.trainer.lab import Lab


class Dashboard:
    """Widgets showing the Lab's per-worker timeline (last ``steps_shown`` steps), stage seconds per
    step, training curves and a sample browser; they update while stages run."""

    def __init__(self, lab: Lab, interval_s: float = 2.0, steps_shown: int = 3, max_spans: int = 50_000) -> None:
        self.lab = lab
        self.interval_s = interval_s
        self.steps_shown = steps_shown
        self.refreshes = 0
        self.refresh_seconds = 0.0  # time spent redrawing, off the training thread
        self.status = widgets.HTML()
        self.graph = widgets.HTML()
        self.graph_stage = widgets.Dropdown(description="stage", options=[])
        self.graph_detail = widgets.HTML()
        self.graph_stage.observe(lambda _: self._show_graph(), names="value")
        self.timeline = LiveFigure()
        self.stage_times = LiveFigure()
        self.curves = LiveFigure()
        self.sample_step = widgets.Dropdown(description="samples of step", style={"description_width": "initial"})
        self.samples = widgets.HTML()
        self.sample_step.observe(lambda _: self._show_samples(), names="value")
        self.widget = themed(widgets.VBox([
            self.status, widgets.HTML("<b>dataflow</b>"), self.graph, self.graph_stage, self.graph_detail,
            self.timeline, self.stage_times, self.curves, self.sample_step, self.samples,
        ]))
        self._spans: deque[Span] = deque(lab.telemetry.spans(), maxlen=max_spans)
        self._span_count = len(self._spans)  # spans ever received (the deque forgets the oldest)
        self._drawn_spans = self._drawn_steps = self._drawn_spans_graph = -1
        self._graph = self._lab_graph()
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._closed = False
        self._last_refresh = 0.0
        self._running_changes = self._drawn_running = 0
        self._unsubscribe = [lab.telemetry.subscribe(self._on_spans),
                             lab.telemetry.subscribe_running(self._on_running),
                             lab.subscribe_steps(lambda _: self._dirty.set())]  # a step's metrics come after its spans
        self.refresh()
        self._thread = threading.Thread(target=self._redraw_loop, name="hybridflow-dashboard", daemon=True)
        self._thread.start()

    def _on_spans(self, spans: list[Span]) -> None:
        self._spans.extend(spans)
        self._span_count += len(spans)
        self._dirty.set()

    def _on_running(self) -> None:
        self._running_changes += 1
        self._dirty.set()

    def _redraw_loop(self) -> None:
        while not self._closed:
            self._dirty.wait()
            time.sleep(max(0.0, self.interval_s - (time.monotonic() - self._last_refresh)))
            if self._closed:
                return
            self._dirty.clear()
            self.refresh()

    def refresh(self) -> None:
        """Redraw the panels whose data changed: the timeline on new spans, the rest on a new step."""
        with self._lock:
            start = time.monotonic()
            span_count, history = self._span_count, list(self.lab.history)
            if span_count != self._drawn_spans:
                self.timeline.show(figures.timeline(figures.recent_steps(list(self._spans), self.steps_shown)))
                self._drawn_spans = span_count
            running = self._running_changes
            if (span_count, running) != (self._drawn_spans_graph, self._drawn_running):
                self._graph = self._lab_graph()
                self._show_graph()
                self._drawn_spans_graph, self._drawn_running = span_count, running
            if len(history) != self._drawn_steps:
                self.stage_times.show(figures.stage_times(history))
                self.curves.show(figures.curves(history))
                self._update_sample_steps()
                self._drawn_steps = len(history)
            self.status.value = (f"<b>{self.lab.name}</b>: step {self.lab.step_index} · {span_count} spans · "
                                 f"{len(history)} steps of metrics")
            self.refreshes += 1
            self._last_refresh = time.monotonic()
            self.refresh_seconds += self._last_refresh - start

    def _lab_graph(self) -> DataflowGraph:
        """``lab.graph()`` from the spans this dashboard holds (the training thread owns the store's polling)."""
        return dataflow_graph(list(self._spans), self.lab.telemetry.running(), self.lab.needs.models,
                              current=self.lab.step_index)

    def _show_graph(self) -> None:
        """Draw the graph with the chosen stage (``graph_stage``) outlined and what it did below."""
        graph, keys = self._graph, [node.key for node in self._graph.nodes]
        if list(self.graph_stage.options) != keys:
            chosen = self.graph_stage.value
            self.graph_stage.options = keys
            self.graph_stage.value = chosen if chosen in keys else None
        chosen = self.graph_stage.value
        self.graph.value = to_svg(graph, chosen or "")
        if chosen is None:
            self.graph_detail.value = ""
            return
        node = graph.node(chosen)
        headline = next((s.headline() for s in self.lab.stage_summaries if s.stage == node.stage and
                         s.step == graph.step), "")
        self.graph_detail.value = node_html(node, headline)

    def _update_sample_steps(self) -> None:
        """Offer every step with samples; keep the user's choice unless it was the newest step."""
        chosen, options = self.sample_step.value, self.sample_step.options
        following = chosen is None or chosen == max(options, default=None)
        steps = sorted({row["step"] for row in self.lab.samples}, reverse=True)
        self.sample_step.options = steps
        if steps:
            self.sample_step.value = steps[0] if following or chosen not in steps else chosen
        self._show_samples()

    def _show_samples(self) -> None:
        rows = [row for row in self.lab.samples if row["step"] == self.sample_step.value]
        self.samples.value = figures.samples_html(rows)

    def close(self) -> None:
        """Stop following the Lab and close the widgets."""
        self._closed = True
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._dirty.set()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


_open: weakref.WeakKeyDictionary[Lab, Dashboard] = weakref.WeakKeyDictionary()


def dashboard(lab: Lab, **options: Any) -> Dashboard:
    """A live dashboard of ``lab`` (``Dashboard``'s ``options``); replaces, and closes, the one shown before."""
    if lab in _open:
        _open[lab].close()
    _open[lab] = Dashboard(lab, **options)
    return _open[lab]
