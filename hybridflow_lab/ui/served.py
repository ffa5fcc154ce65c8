"""The run dashboard served by panel from a run directory's JSONL files (``hybridflow-lab dashboard``), or the
comparison of several runs (``--run A --run B``).

It follows the files while a CLI run writes them, so any run (notebook, script, CLI) can be watched
from a browser. In a notebook, ``dashboard_app(run_dir)`` displays inline (no CDN needed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import panel as pn

from hybridflow_lab.exposure import LOOPBACK, checked_bind_address
from hybridflow_lab.telemetry import dataflow_graph
from hybridflow_lab.telemetry.dataflow_graph import to_svg
from hybridflow_lab.ui import figures
from hybridflow_lab.ui.run_compare import compare_runs
from hybridflow_lab.ui.run_files import RunFiles


def dashboard_app(run_dir: str | os.PathLike[str], period_ms: int = 1000, steps_shown: int = 3) -> pn.Column:
    """A panel layout of the run's dataflow graph, timeline, stage times, curves and latest samples, polling every
    ``period_ms``."""
    pn.extension("plotly", inline=True)
    run = RunFiles(run_dir)
    status = pn.pane.Markdown(sizing_mode="stretch_width")
    graph = pn.pane.HTML(sizing_mode="stretch_width")
    timeline = pn.pane.Plotly(sizing_mode="stretch_width")
    stage_times = pn.pane.Plotly(sizing_mode="stretch_width")
    curves = pn.pane.Plotly(sizing_mode="stretch_width")
    samples = pn.pane.HTML(sizing_mode="stretch_width")

    def update() -> None:
        if not run.poll() and timeline.object is not None:
            return
        graph.object = to_svg(dataflow_graph(run.spans))
        timeline.object = figures.timeline(figures.recent_steps(run.spans, steps_shown))
        stage_times.object = figures.stage_times(run.metrics)
        curves.object = figures.curves(run.metrics)
        last_step = max((row["step"] for row in run.samples), default=None)
        samples.object = figures.samples_html([row for row in run.samples if row["step"] == last_step])
        status.object = (f"**{Path(run_dir).name}**: {len(run.metrics)} steps, {len(run.spans)} spans "
                         f"(following `{run_dir}`)")

    update()
    if pn.state.curdoc is not None:  # a served session: keep following the files
        pn.state.add_periodic_callback(update, period=period_ms)
    return pn.Column(pn.pane.Markdown("## HybridFlow Lab run dashboard"), status,
                     pn.pane.Markdown("### dataflow of the last step"), graph, timeline, stage_times, curves,
                     pn.pane.Markdown("### latest samples"), samples, sizing_mode="stretch_width")


def compare_app(run_dirs: Sequence[str | os.PathLike[str]], period_ms: int = 1000) -> pn.Column:
    """A panel layout comparing runs (``compare_runs``): their config differences, curves and stage seconds."""
    pn.extension("plotly", inline=True)
    comparison = compare_runs(run_dirs)
    curves = pn.pane.Plotly(comparison.curves, sizing_mode="stretch_width")
    stage_times = pn.pane.Plotly(comparison.stage_times, sizing_mode="stretch_width")

    def update() -> None:
        if comparison.refresh():
            curves.object, stage_times.object = comparison.curves, comparison.stage_times

    if pn.state.curdoc is not None:
        pn.state.add_periodic_callback(update, period=period_ms)
    runs = ", ".join(f"`{label}`" for label in comparison.runs)
    return pn.Column(pn.pane.Markdown(f"## HybridFlow Lab runs compared: {runs}"),
                     pn.pane.Markdown("### config differences"),
                     pn.pane.DataFrame(comparison.differences, sizing_mode="stretch_width"), curves, stage_times,
                     sizing_mode="stretch_width")


def serve(run_dirs: Sequence[str | os.PathLike[str]], port: int = 5006, address: str = LOOPBACK,
          period_ms: int = 1000, expose: bool = False) -> None:
    """Serve the dashboard of the run directory in ``run_dirs`` (with several: their comparison) on
    ``address:port`` until interrupted.

    A non-loopback ``address`` needs ``expose=True`` (``--expose``) and logs a warning: the page has no login.
    """
    for run_dir in run_dirs:
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"no run directory {run_dir}; pass the trainer.run_dir of a run")
    address = checked_bind_address(address, expose, "the run dashboard", "--expose (expose=True in Python)")
    origins = [f"{address}:{port}", f"localhost:{port}"]
    print(f"[dashboard] http://{address}:{port}/ following {', '.join(map(str, run_dirs))}", flush=True)

    def session() -> pn.Column:  # one layout per browser session (panel needs a plain function here)
        return dashboard_app(run_dirs[0], period_ms) if len(run_dirs) == 1 else compare_app(run_dirs, period_ms)

    pn.serve({"/": session}, address=address, port=port, show=False,
             allow_websocket_origin=origins, title="HybridFlow Lab")
