"""Transfer protocols as pure functions: how arguments split and results merge."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Dispatch, DispatchMode, GroupLayout, Mesh, register, register_dispatch_mode
from hybridflow_lab.controller.dispatch import resolve_dispatch_mode


def rows(n: int) -> DataBatch:
    return DataBatch({"x": torch.arange(n)})


def test_dp_compute_pads_then_drops_padding():
    layout = GroupLayout(4)
    split = Dispatch.DP_COMPUTE.split(layout, (), {"batch": rows(10), "factor": 3})
    assert split.pad == 2 and split.rows == 12
    assert [call[1]["batch"]["x"].tolist() for call in split.per_rank] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert all(call[1]["factor"] == 3 for call in split.per_rank)
    outputs = [call[1]["batch"] for call in split.per_rank]
    assert Dispatch.DP_COMPUTE.collect(layout, outputs, split)["x"].tolist() == list(range(10))


def test_dp_compute_unpads_outputs_that_scale_rows():
    layout = GroupLayout(4)
    split = Dispatch.DP_COMPUTE.split(layout, (), {"batch": rows(6)})
    outputs = [call[1]["batch"].repeat(2) for call in split.per_rank]  # two samples per prompt
    merged = Dispatch.DP_COMPUTE.collect(layout, outputs, split)
    assert merged["x"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_dp_compute_rejects_what_it_cannot_split():
    layout = GroupLayout(2)
    with pytest.raises(TypeError, match=r"argument 'ids' is a Tensor. Wrap it in a DataBatch"):
        Dispatch.DP_COMPUTE.split(layout, (), {"ids": torch.zeros(4)})
    with pytest.raises(TypeError, match=r"needs at least one DataBatch argument.*n: int"):
        Dispatch.DP_COMPUTE.split(layout, (), {"n": 3})
    with pytest.raises(ValueError, match=r"a has 4 rows, b has 3 rows"):
        Dispatch.DP_COMPUTE.split(layout, (), {"a": rows(4), "b": rows(3)})
    with pytest.raises(ValueError, match=r"empty DataBatch"):
        Dispatch.DP_COMPUTE.split(layout, (), {"a": rows(0)})


def test_mesh_splits_along_dp_and_collects_tp0_of_last_stage():
    layout = GroupLayout(8, {"train": Mesh.of(pp=2, dp=2, tp=2)})
    mode = Dispatch.MESH("train")
    split = mode.split(layout, (), {"batch": rows(4)})
    # ranks sharing a dp coordinate get the same chunk, whatever their tp / pp coordinate
    chunks = [call[1]["batch"]["x"].tolist() for call in split.per_rank]
    assert chunks == [[0, 1], [0, 1], [2, 3], [2, 3], [0, 1], [0, 1], [2, 3], [2, 3]]
    assert split.concat_ranks == [4, 6]  # pp=1 (last stage), tp=0, dp=0 then dp=1
    outputs = [DataBatch({"rank": torch.tensor([r])}) for r in range(8)]
    assert mode.collect(layout, outputs, split)["rank"].tolist() == [4, 6]


def test_mesh_mode_is_checked_against_the_group():
    with pytest.raises(KeyError, match=r"no mesh named 'rollout'"):
        Dispatch.MESH("rollout").validate(GroupLayout(4, {"train": Mesh.of(dp=4)}))


def test_all_to_all_needs_one_entry_per_rank():
    layout = GroupLayout(3)
    split = Dispatch.ALL_TO_ALL.split(layout, (), {"seed": [7, 8, 9]})
    assert [call[1]["seed"] for call in split.per_rank] == [7, 8, 9]
    with pytest.raises(TypeError, match=r"one entry per rank \(3 ranks\); argument 'seed' is a list of length 2"):
        Dispatch.ALL_TO_ALL.split(layout, (), {"seed": [1, 2]})


def test_custom_mode_by_functions_and_by_name():
    def split(layout, args, kwargs):
        return [((), {"value": kwargs["value"] + rank}) for rank in range(layout.world_size)]

    mode = register_dispatch_mode("PLUS_RANK", split, lambda layout, outputs: sum(outputs))
    assert resolve_dispatch_mode("PLUS_RANK") is mode
    done = mode.split(GroupLayout(3), (), {"value": 10})
    assert [c[1]["value"] for c in done.per_rank] == [10, 11, 12]
    assert mode.collect(GroupLayout(3), [1, 2, 3], done) == 6

    @register("PLUS_RANK")
    def method(self, value):
        return value

    assert method.__hybridflow_register__.dispatch is mode


def test_custom_mode_subclass_and_builtin_names_are_protected():
    class Reverse(DispatchMode):
        name = "REVERSE_TEST"

    assert register_dispatch_mode(Reverse()).name == "REVERSE_TEST"
    with pytest.raises(ValueError, match=r"built-in"):
        register_dispatch_mode("DP_COMPUTE", lambda *a: [], lambda *a: None)
    with pytest.raises(ValueError, match=r"unknown dispatch mode 'NOPE'"):
        register("NOPE")
