"""``compare(*replays)``: algorithms side by side on one captured batch (``lab.replay``): a table of their
advantages and probed updates, and heat maps of the advantages and the policy loss over tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hybridflow_lab.trainer.replay import Replayed
from hybridflow_lab.ui.live_figure import LiveFigure
from hybridflow_lab.ui.theme import themed

UPDATE_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/entropy")


class ReplayComparison:
    """``table`` (one row per replay) and ``figure`` (a heat map pair per replay); displays both (``widget``)."""

    def __init__(self, replays: Sequence[Replayed]) -> None:
        if not replays:
            raise ValueError("compare needs at least one replay (lab.replay(step, stage, ...))")
        batches = {(r.step, r.stage, len(r.batch)) for r in replays}
        if len(batches) > 1:
            raise ValueError(f"compare sets replays of one captured batch side by side; these replay {sorted(batches)} "
                             "(step, stage, rows)")
        self.replays = list(replays)
        self.table = pd.DataFrame([_row(r) for r in self.replays]).set_index("replay")
        self.figure = heatmaps(self.replays)

        self.widget = themed(widgets.VBox([widgets.HTML(self.table.to_html(float_format="{:.4g}".format)),
                                           LiveFigure(self.figure)]))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def compare(*replays: Replayed) -> ReplayComparison:
    """The replays of one captured batch side by side."""
    return ReplayComparison(replays)


def _row(replay: Replayed) -> dict[str, Any]:
    mask = replay.batch["response_mask"].bool()
    advantages = replay.batch["advantages"][mask]
    return {"replay": replay.name, "advantage mean": float(advantages.mean()),
            "advantage std": float(advantages.std()), "mean |advantage|": float(advantages.abs().mean()),
            "zero-advantage tokens": float((advantages == 0).float().mean()),
            **{key.removeprefix("actor/"): replay.metrics.get(key, float("nan")) for key in UPDATE_METRICS}}


def heatmaps(replays: Sequence[Replayed]) -> go.Figure:
    """Per replay, its advantages and its policy loss over (sequence, response token); off-mask tokens blank."""
    titles = [f"{r.name}: {what}" for r in replays for what in ("advantage", "policy loss")]
    figure = make_subplots(rows=len(replays), cols=2, subplot_titles=titles, horizontal_spacing=0.08,
                           vertical_spacing=0.12 / max(1, len(replays) - 1) if len(replays) > 1 else 0.1)
    limit = max(float(r.batch["advantages"].abs().max()) for r in replays) or 1.0
    for index, replay in enumerate(replays):
        mask = replay.batch["response_mask"].bool()
        for col, (values, scale) in enumerate(((replay.batch["advantages"], limit), (replay.token_loss, None)), 1):
            shown = [[value if keep else None for value, keep in zip(row, kept, strict=True)]  # None: a blank cell
                     for row, kept in zip(values.float().tolist(), mask.tolist(), strict=True)]
            figure.add_trace(go.Heatmap(z=shown, colorscale="RdBu", zmid=0, showscale=col == 1 and index == 0,
                                        zmin=-scale if scale else None, zmax=scale if scale else None,
                                        hovertemplate="sequence %{y}, token %{x}: %{z:.4f}<extra></extra>"),
                             row=index + 1, col=col)
    figure.update_layout(title="the same batch through each replay (x: response token, y: sequence)",
                         height=220 * len(replays) + 80, margin={"l": 10, "r": 10, "t": 60, "b": 30})
    return figure
