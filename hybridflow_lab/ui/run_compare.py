"""``compare_runs([dir, ...])``: several run directories side by side: their configs' differences, their curves
on the same panels and their stage seconds (notebook and served dashboard)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from hybridflow_lab.trainer.run_log import CONFIG_FILE
from hybridflow_lab.ui import figures
from hybridflow_lab.ui.live_figure import LiveFigure
from hybridflow_lab.ui.run_files import RunFiles
from hybridflow_lab.ui.theme import themed

NOT_COMPARED = ("trainer.run_dir",)  # differs between any two runs and says nothing about them


class RunComparison:
    """``differences`` (the config keys whose values differ, one column per run), ``curves`` and ``stage_times``
    (median seconds of each stage per run); ``refresh()`` reads what the runs appended since."""

    def __init__(self, run_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None) -> None:
        if len(run_dirs) < 2:
            raise ValueError("compare_runs needs two or more run directories")
        missing = [str(d) for d in run_dirs if not Path(d).is_dir()]
        if missing:
            raise FileNotFoundError(f"no run directory {missing[0]}; pass the trainer.run_dir of each run")
        names = list(labels) if labels is not None else _labels(run_dirs)
        self.runs = dict(zip(names, (RunFiles(d) for d in run_dirs), strict=True))
        self.differences = config_differences({label: _config(run.run_dir) for label, run in self.runs.items()})
        self.refresh()

    def refresh(self) -> bool:
        """Read the runs' new metrics; True when any changed (the figures are rebuilt then)."""
        changed = [run.poll() for run in self.runs.values()]
        if any(changed) or not hasattr(self, "curves"):
            histories = {label: run.metrics for label, run in self.runs.items()}
            self.curves = figures.run_curves(histories, "training curves, run by run")
            self.stage_times = stage_medians(histories)
        return any(changed)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        shown = themed(widgets.VBox([widgets.HTML("<b>config differences</b>" + self.differences.to_html()),
                                     LiveFigure(self.curves), LiveFigure(self.stage_times)]))
        return shown._repr_mimebundle_(**kwargs)


def compare_runs(run_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None) -> RunComparison:
    """The runs in ``run_dirs`` side by side (labelled by their directory names unless ``labels``)."""
    return RunComparison(run_dirs, labels)


def config_differences(configs: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """The dotted config keys whose values differ between runs (rows), one column per run; a run without a
    ``config.json`` (written by runs since it existed) shows ``?``."""
    flat = {label: _flatten(config) for label, config in configs.items()}
    keys = sorted({key for values in flat.values() for key in values} - set(NOT_COMPARED))
    differing = [k for k in keys if len({json.dumps(values.get(k, "?"), default=str) for values in flat.values()}) > 1]
    return pd.DataFrame({label: [values.get(k, "?") for k in differing] for label, values in flat.items()},
                        index=pd.Index(differing, name="config key"))


def stage_medians(histories: Mapping[str, Sequence[Mapping[str, Any]]]) -> go.Figure:
    """Grouped bars: each stage's median seconds per step, one bar per run."""
    stages = sorted({k for history in histories.values() for m in history for k in m
                     if k.startswith("timing_s/") and k != "timing_s/step"})
    figure = go.Figure([go.Bar(name=label, x=[s.removeprefix("timing_s/") for s in stages],
                               y=[_median(history, s) for s in stages]) for label, history in histories.items()])
    figure.update_layout(title="median seconds per step, stage by stage", barmode="group", yaxis_title="seconds",
                         height=340, margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return figure


def _median(history: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [m[key] for m in history if key in m]
    return statistics.median(values) if values else None


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    names = [Path(d).name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
