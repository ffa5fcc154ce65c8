"""The auto-mapping figures: plan Gantt bars start and last what the plans say; predicted vs measured bars."""

from __future__ import annotations

import pytest

from hybridflow_lab.hybrid import ParallelLayout
from hybridflow_lab.placement.automap import AutoMapper, ColocatedSet, plan_of
from hybridflow_lab.placement.hardware import get_profile
from hybridflow_lab.placement.simulator import ModelCost
from hybridflow_lab.placement.workload import Workload
from hybridflow_lab.ui.plan_figure import plan_gantt, predicted_vs_measured

STAGES = ("generation", "preparation", "training")


def colocated(devices, **seconds_by_role):
    """A set whose roles cost the given (generation, preparation, training) seconds."""
    costs = tuple(ModelCost(role, ParallelLayout(d=devices), dict(zip(STAGES, seconds, strict=True)), 0.0)
                  for role, seconds in seconds_by_role.items())
    return ColocatedSet(tuple(seconds_by_role), devices, costs)


ACTOR_SET = colocated(8, actor=(10.0, 2.0, 6.0), reference=(0.0, 1.0, 0.0))  # 10, 3, 6
CRITIC_SET = colocated(8, critic=(0.0, 4.0, 5.0), reward=(0.0, 1.0, 0.0))  # 0, 5, 5


def traces(figure):
    return {trace.name: trace for trace in figure.data}


def test_side_by_side_sets_start_together_and_the_stage_lasts_as_long_as_the_slowest():
    split = plan_of((ACTOR_SET, CRITIC_SET), STAGES)  # concurrent: each stage is the slower set's
    alone = plan_of((colocated(16, actor=(7.0, 1.5, 4.0)),), STAGES)
    figure = plan_gantt([alone, split])
    bars = traces(figure)
    assert list(bars["generation"].y) == ["#1 colocate", "#2 split"]
    assert list(bars["generation"].x) == [7.0, 10.0] and list(bars["generation"].base) == [0.0, 0.0]
    assert list(bars["preparation"].x) == [1.5, 5.0] and list(bars["preparation"].base) == [7.0, 10.0]
    assert list(bars["training"].x) == [4.0, 6.0] and list(bars["training"].base) == [8.5, 15.0]
    assert [b + x for b, x in zip(bars["training"].base, bars["training"].x, strict=True)] == \
        [alone.total_s, split.total_s]
    by_set = bars["preparation by set"]  # one thin bar per set, all from the stage's start
    assert list(by_set.y) == ["#1 colocate", "#2 split", "#2 split"]
    assert list(by_set.x) == [1.5, 3.0, 5.0] and list(by_set.base) == [7.0, 10.0, 10.0]
    assert by_set.offset[1] != by_set.offset[2] and by_set.width[1] < by_set.width[0]
    assert "actor+reference on 8" in by_set.customdata[1] and "critic+reward on 8" in by_set.customdata[2]
    assert "controller" not in bars and figure.layout.yaxis.autorange == "reversed"


def test_sets_called_in_turn_follow_each_other_and_the_controller_comes_last():
    plan = plan_of((ACTOR_SET, CRITIC_SET), STAGES, concurrent=False, controller_s=0.5)  # the Lab's order
    bars = traces(plan_gantt([plan], labels=["lab"]))
    assert list(bars["preparation"].x) == [8.0] and list(bars["preparation"].base) == [10.0]
    by_set = bars["preparation by set"]
    assert list(by_set.x) == [3.0, 5.0] and list(by_set.base) == [10.0, 13.0]
    assert list(bars["controller"].base) == [10.0 + 8.0 + 11.0] and list(bars["controller"].x) == [0.5]


def test_labels_must_match_the_plans():
    plan = plan_of((ACTOR_SET,), STAGES)
    with pytest.raises(ValueError, match="distinct labels"):
        plan_gantt([plan, plan], labels=["same", "same"])
    with pytest.raises(ValueError):
        plan_gantt([plan], labels=["a", "b"])


def test_searched_plans_end_at_their_total():
    plans = AutoMapper(Workload.paper_ppo("7B"), get_profile("a100-80gb"), 16).search(top=3)
    bars = traces(plan_gantt(plans))
    last = bars["training"]  # the last stage; the A100 profile has no controller seconds
    ends = [base + length for base, length in zip(last.base, last.x, strict=True)]
    assert ends == pytest.approx([plan.total_s for plan in plans])
    assert sum(len(plan.sets) for plan in plans) == len(bars["generation by set"].x)


def test_predicted_vs_measured_groups_bars_per_stage():
    figure = predicted_vs_measured({"generation": 2.0, "training": 1.0}, {"generation": 2.5, "training": 0.8,
                                                                           "step": 4.0})
    predicted, measured = figure.data
    assert (predicted.name, measured.name) == ("predicted", "measured") and figure.layout.barmode == "group"
    assert list(predicted.x) == list(measured.x) == ["generation", "training", "step"]
    assert list(predicted.y) == [2.0, 1.0, None] and list(measured.y) == [2.5, 0.8, 4.0]
    assert list(predicted.text) == ["2.00", "1.00", ""]
