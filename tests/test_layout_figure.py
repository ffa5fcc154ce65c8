"""The 3D-HybridEngine figures: which training shards each rank holds before and after, and the bytes chart."""

from __future__ import annotations

from hybridflow_lab.hybrid import ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.ui.layout_figure import RECEIVED, bytes_figure, shard_layout_figure


def panel_bars(figure, xaxis):
    """{training shard: {rank: bar pattern}} for the bars drawn on one panel's x axis."""
    bars = {}
    for trace in figure.data:
        if trace.type == "bar" and trace.xaxis == xaxis:
            patterns = trace.marker.pattern.shape or [""] * len(trace.x)
            assert trace.base == int(trace.name[1:])  # shard Ti is drawn at height i
            bars[trace.name] = dict(zip(trace.x, patterns, strict=True))
    return bars


def labels(figure):
    """{rank: "G0 = T0+T1"}: what the right panel's hover text says each rank's generation shard is made of."""
    trace = next(trace for trace in figure.data if trace.name == "generation shard")
    made_of = {}
    for rank, text, hover in zip(trace.x, trace.text, trace.hovertext, strict=True):
        assert hover.startswith(f"rank {rank}: {text} = ")
        made_of[rank] = hover.split("<br>")[0].removeprefix(f"rank {rank}: ")
    return made_of


def test_figure_8_layout_after_the_micro_dp_all_gather():
    figure = shard_layout_figure(ParallelLayout(t=4, tg=2, d=2))
    before, after = panel_bars(figure, "x"), panel_bars(figure, "x2")
    assert {shard: sorted(ranks) for shard, ranks in before.items()} == {
        "T0": [0, 4], "T1": [1, 5], "T2": [2, 6], "T3": [3, 7]}
    assert labels(figure) == {0: "G0 = T0+T1", 1: "G0 = T0+T1", 2: "G1 = T2+T3", 3: "G1 = T2+T3",
                              4: "G0 = T0+T1", 5: "G0 = T0+T1", 6: "G1 = T2+T3", 7: "G1 = T2+T3"}
    # rank 0 keeps T0 and receives T1 from rank 1, and the other way round
    assert after["T0"] == {0: "", 1: RECEIVED, 4: "", 5: RECEIVED}
    assert after["T1"] == {0: RECEIVED, 1: "", 4: RECEIVED, 5: ""}
    boxes = [(shape.x0 + 0.48, shape.x1 - 0.48) for shape in figure.layout.shapes]
    assert boxes == [(0, 1), (2, 3), (4, 5), (6, 7)]  # one box per micro-DP group, around consecutive ranks
    assert "1-4-2" in figure.layout.annotations[0].text and "1-2-2-2" in figure.layout.annotations[1].text
    hover = next(trace for trace in figure.data if trace.name == "generation shard").hovertext
    assert "micro-DP group [0, 1]" in hover[0] and "generation TP group [0, 2]" in hover[0]


def test_generation_tp_1_gathers_the_whole_training_tp_group():
    figure = shard_layout_figure(ParallelLayout(t=2, tg=1, d=2))
    assert set(labels(figure).values()) == {"G0 = T0+T1"}
    assert sum(pattern == RECEIVED for bars in panel_bars(figure, "x2").values() for pattern in bars.values()) == 4


def test_nothing_changes_when_generation_tp_equals_training_tp():
    figure = shard_layout_figure(ParallelLayout(t=4, tg=4, d=1))
    before, after = panel_bars(figure, "x"), panel_bars(figure, "x2")
    assert after == before == {f"T{shard}": {shard: ""} for shard in range(4)}
    assert labels(figure) == {rank: f"G{rank} = T{rank}" for rank in range(4)}
    assert not figure.layout.shapes


def test_bytes_figure_has_a_bar_and_a_formula_marker_per_row():
    layout, model_bytes = ParallelLayout(t=4, tg=2), 1000
    rows = [{"strategy": strategy, "t": 4, "tg": 2, "bytes_per_rank": measured,
             "formula_bytes_per_rank": formula_bytes_per_rank(strategy, layout, model_bytes)}
            for strategy, measured in (("hybridflow", 250), ("hybridflow_v", 750), ("ds_chat", 700))]
    bars, formula = bytes_figure(rows).data
    assert bars.type == "bar" and list(bars.y) == [250, 750, 700]
    assert [list(level) for level in bars.x] == [["t=4, tg=2"] * 3, ["hybridflow", "hybridflow_v", "ds_chat"]]
    assert formula.mode == "markers" and list(formula.y) == [250, 750, 750]
    assert len(set(bars.marker.color)) == 3  # one colour per strategy
