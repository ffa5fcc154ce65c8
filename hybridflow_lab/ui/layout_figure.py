"""Plotly pictures of the 3D-HybridEngine: the shard each rank holds in training and in generation, and bytes moved.

The actor's TP-split weights are drawn as ``t`` stacked training shards ``T0 .. T{t-1}`` (one colour each). In
generation a rank holds its micro-DP group's training shards, in rank order: a solid block was already on the
rank, a hatched one arrived in the micro-DP all-gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from hybridflow_lab.hybrid import STRATEGIES, ParallelLayout

COLORS = qualitative.Plotly
RECEIVED = "/"  # bar pattern of a block that arrived from another rank


def shard_layout_figure(layout: ParallelLayout) -> go.Figure:
    """Left: each rank's training shard (TP ``t``). Right: its generation shard (TP ``tg``), boxed by micro-DP group.

    The right panel's text trace ``"generation shard"`` names each rank's shard (``G0``); its hover text says
    what it is made of (``G0 = T0+T1``) and the rank's micro-DP and generation TP groups.
    """
    t, ranks = layout.t, range(layout.world_size)
    group_of = {rank: group for group in layout.micro_dp_groups() for rank in group}
    # each rank's generation shard: its micro-DP group's training shards, in order
    pieces = {rank: [layout.training_tp_rank(peer) for peer in group_of[rank]] for rank in ranks}
    tp_group_of = {rank: group for group in layout.generation_tp_groups() for rank in group}
    figure = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=(
        f"training  p-t-d = {layout.p}-{t}-{layout.d}",
        f"generation  pg-tg-dg-d = {layout.pg}-{layout.tg}-{layout.dg}-{layout.d}  (hatched: received)"))
    for shard in range(t):
        style = {"marker_color": COLORS[shard % len(COLORS)], "legendgroup": f"T{shard}", "base": shard,
                 "text": f"T{shard}", "textposition": "inside", "insidetextanchor": "middle", "width": 0.8}
        holders = [rank for rank in ranks if layout.training_tp_rank(rank) == shard]
        figure.add_trace(go.Bar(name=f"T{shard}", x=holders, y=[1] * len(holders), **style), row=1, col=1)
        gatherers = [rank for rank in ranks if shard in pieces[rank]]
        figure.add_trace(go.Bar(name=f"T{shard}", x=gatherers, y=[1] * len(gatherers), showlegend=False,
                                marker_pattern_shape=["" if layout.training_tp_rank(rank) == shard else RECEIVED
                                                      for rank in gatherers],
                                **style), row=1, col=2)
    names = {rank: f"G{layout.generation_tp_rank(rank)}" for rank in ranks}
    figure.add_trace(go.Scatter(
        name="generation shard", mode="text", showlegend=False, x=list(ranks),
        y=[pieces[rank][-1] + 1.25 for rank in ranks], text=[names[rank] for rank in ranks],
        hovertext=[f"rank {rank}: {names[rank]} = {'+'.join(f'T{p}' for p in pieces[rank])}<br>"
                   f"micro-DP group {group_of[rank]}<br>generation TP group {tp_group_of[rank]}" for rank in ranks],
        hoverinfo="text"), row=1, col=2)
    if layout.dg > 1:
        for group in layout.micro_dp_groups():
            low = pieces[group[0]][0]
            figure.add_shape(type="rect", x0=group[0] - 0.48, x1=group[-1] + 0.48, y0=low - 0.08,
                             y1=low + layout.dg + 0.08, line={"dash": "dot", "color": "gray"}, row=1, col=2)
    ticks = {"tickvals": list(ranks), "ticktext": [f"r{rank}" for rank in ranks], "title": "rank"}
    figure.update_xaxes(**ticks)
    figure.update_yaxes(title="model weights, in training shards", showticklabels=False, range=[0, t + 0.8],
                        row=1, col=1)
    figure.update_layout(barmode="overlay", height=320 + 30 * t, legend_title="training shard",
                         margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return figure


def bytes_figure(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Bytes a rank receives going to generation, per layout and strategy: measured bars, Table 2 formula markers.

    ``rows`` are ``hybridflow_lab.bench.reshard.run(...)["results"]``.
    """
    x = [[f"t={row['t']}" + (f", p={row['p']}" if row.get("p", 1) > 1 else "") + f", tg={row['tg']}" for row in rows],
         [row["strategy"] for row in rows]]
    colors = [COLORS[STRATEGIES.index(row["strategy"])] for row in rows]
    figure = go.Figure([
        go.Bar(name="measured", x=x, y=[row["bytes_per_rank"] for row in rows], marker_color=colors),
        go.Scatter(name="Table 2 formula", x=x, y=[row["formula_bytes_per_rank"] for row in rows], mode="markers",
                   marker={"symbol": "line-ew-open", "size": 40, "color": "black", "line": {"width": 3}}),
    ])
    figure.update_layout(title="bytes received per rank, training -> generation", yaxis_title="bytes", height=380,
                         margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return figure
