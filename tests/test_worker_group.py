"""Worker groups on both backends: every transfer protocol, colocation, futures, errors, telemetry."""

from __future__ import annotations

import os

import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import (
    DataBatchFuture,
    Mesh,
    ResourcePool,
    Role,
    WorkerCallError,
    WorkerGroup,
)
from hybridflow_lab.telemetry import Phase, TelemetryStore
from tests.workers import Actor, Consumer, Echo, MeshWorker, Ref


def rows(n: int) -> DataBatch:
    return DataBatch({"x": torch.arange(n, dtype=torch.float32)}, {"text": [f"row{i}" for i in range(n)]})


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.ray)])
def echo(request):
    """A 4-rank Echo group with its own telemetry store, on each backend."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    group = WorkerGroup(Role(Echo, tag="t"), ResourcePool(4), backend=request.param, telemetry=TelemetryStore())
    yield group
    group.shutdown()


def test_one_to_all_reaches_every_rank(echo):
    where = echo.where()
    assert [w["rank"] for w in where] == [0, 1, 2, 3]
    assert {w["world_size"] for w in where} == {4} and {w["tag"] for w in where} == {"t"}
    pids = {w["pid"] for w in where}
    if echo.backend_name == "ray":
        assert len(pids) == 4 and os.getpid() not in pids and all(w["distributed"] for w in where)
    else:
        assert pids == {os.getpid()}  # in-process: a breakpoint in the worker stops the notebook


def test_rank_zero_all_to_all_and_a_user_registered_mode(echo):
    assert echo.rank_zero_only(7) == (0, 7)
    assert echo.per_rank([10, 11, 12, 13]) == [(0, 10), (1, 11), (2, 12), (3, 13)]
    assert echo.rank_again() == [3, 2, 1, 0]  # REVERSED_TEST, registered in tests/workers.py


def test_dp_compute_pads_splits_and_restores_order(echo):
    out = echo.scale(rows(10), factor=3.0)
    assert out["y"].tolist() == [3.0 * i for i in range(10)]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # 12 padded rows, 3 per rank, 2 dropped
    assert out.meta["rank"] == [0, 1, 2, 3]  # meta that differs across ranks: one entry per rank


def test_dp_compute_with_outputs_that_multiply_rows(echo):
    out = echo.expand(rows(6), n=2)
    assert out["x"].tolist() == [float(i) for i in range(6) for _ in range(2)]
    assert out["text"].tolist()[:4] == ["row0", "row0", "row1", "row1"]


def test_workers_cannot_change_the_controllers_batch(echo):
    batch = rows(8)
    out = echo.mutate_input(batch)
    assert batch["x"].tolist() == list(range(8)) and out["x"][0].item() == 100.0


def test_bad_calls_fail_on_the_controller_with_what_was_expected(echo):
    with pytest.raises(TypeError, match=r"scale\(batch: 'DataBatch', factor: 'float' = 2.0\).*missing"):
        echo.scale()
    with pytest.raises(TypeError, match=r"argument 'batch' is a Tensor. Wrap it in a DataBatch"):
        echo.scale(torch.zeros(4))
    with pytest.raises(TypeError, match=r"one entry per rank"):
        echo.per_rank(5)


def test_failing_rank_raises_one_error_naming_it(echo):
    with pytest.raises(WorkerCallError) as info:
        echo.fail_on(2)
    error = info.value
    assert (error.group, error.role, error.rank, error.method) == (echo.name, "echo", 2, "fail_on")
    assert "ValueError: rank 2 was told to fail" in str(error)
    assert "raise ValueError" in error.remote_traceback
    assert echo.where()[2]["rank"] == 2  # the group stays usable


def test_every_call_records_dispatch_execute_collect_spans(echo):
    echo.telemetry.clear()
    echo.telemetry.step = 5
    echo.timed(rows(8))
    call_id = echo.telemetry.spans(name="timed", phase=Phase.CALL)[0].call_id
    spans = echo.telemetry.spans(call_id=call_id)
    phases = sorted(s.phase.value for s in spans)
    assert phases == ["call", "collect", "dispatch", "execute", "execute", "execute", "execute",
                      "worker", "worker", "worker", "worker"]
    assert {s.step for s in spans} == {5}
    call = next(s for s in spans if s.phase is Phase.CALL)
    for span in (s for s in spans if s.phase is Phase.EXECUTE):
        assert span.attrs["bytes_in"] == 2 * 4 + 2 * 8  # two float32 rows in, plus the text column pointers
        assert call.t_start - 0.01 <= span.t_start <= span.t_end <= call.t_end + 0.01  # aligned clocks
    inner = [s for s in spans if s.phase is Phase.WORKER]
    assert sorted(s.rank for s in inner) == [0, 1, 2, 3]
    assert {s.name for s in inner} == {"inner"} and all(s.bytes_moved == 123 and s.attrs == {"note": "hello"}
                                                        for s in inner)
    dispatch = next(s for s in spans if s.phase is Phase.DISPATCH)
    assert dispatch.bytes_moved == rows(8).nbytes
    echo.telemetry.step = None


def test_future_feeds_another_group_without_the_controller(echo):
    consumer = WorkerGroup(Consumer, ResourcePool(2), backend=echo.backend_name, telemetry=echo.telemetry)
    try:
        future = echo.scale_async(rows(8))
        assert isinstance(future, DataBatchFuture)
        out = consumer.consume(future)
        assert out["x"].tolist() == [10.0 * i + 1 for i in range(8)]
        assert out["producer_rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert out["consumer_rank"].tolist() == [0] * 4 + [1] * 4
        assert not echo.telemetry.spans(name="scale_async", phase=Phase.COLLECT)  # never fetched by the controller
        consume_dispatch = consumer.telemetry.spans(name="consume", phase=Phase.DISPATCH)[-1]
        assert consume_dispatch.bytes_moved == 0  # rows went worker to worker, not through the controller
        assert future.get()["x"].tolist() == [10.0 * i for i in range(8)]  # and can still be fetched
    finally:
        consumer.shutdown()


def test_future_sent_whole_to_every_rank(echo):
    future = echo.scale_async(rows(8))
    assert echo.count_rows(future) == [8, 8, 8, 8]
    assert "scale_async" in repr(future) and future.done()


def test_future_with_padding_is_materialised_correctly(echo):
    consumer = WorkerGroup(Consumer, ResourcePool(2), backend=echo.backend_name, telemetry=echo.telemetry)
    try:
        out = consumer.consume(echo.scale_async(rows(6)))  # 6 rows on 4 ranks: padded, so not pass-through
        assert out["x"].tolist() == [10.0 * i + 1 for i in range(6)]
    finally:
        consumer.shutdown()


def test_colocated_roles_share_each_rank_process(backend):
    group = WorkerGroup({"actor": Role(Actor, 2.0), "ref": Ref}, ResourcePool(2), backend=backend)
    try:
        acted = group.actor.act(rows(4))
        referenced = group.ref.ref(rows(4))
        assert acted["y"].tolist() == [0.0, 2.0, 4.0, 6.0] and referenced["z"].tolist() == [0.0, -1.0, -2.0, -3.0]
        assert torch.equal(acted["pid"], referenced["pid"])
        if backend == "ray":
            assert acted["pid"][0] != acted["pid"][2]  # one process per rank
        assert "act" in dir(group.actor) and group.actor.act.__doc__ is None
    finally:
        group.shutdown()


@pytest.mark.parametrize(("mesh", "collected"), [
    (Mesh.of(dp=2, tp=2), [0, 0, 2, 2]),  # tp=0 of each dp group
    (Mesh.of(pp=2, dp=2), [2, 2, 3, 3]),  # last pipeline stage
])
def test_mesh_dispatch(backend, mesh, collected):
    group = WorkerGroup(MeshWorker, ResourcePool(4), backend=backend, meshes={"train": mesh})
    try:
        out = group.tag_rows(rows(4))
        assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert out["rank"].tolist() == collected
        assert out["dp"].tolist() == [0, 0, 1, 1]
    finally:
        group.shutdown()


def test_local_ranks_keep_the_controllers_thread_count():
    """Local ranks run in the controller's process (a notebook kernel): building them must not leave the kernel's
    own torch work on one thread."""
    before, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(3)
    try:
        group = WorkerGroup(Role(Echo, tag="t"), ResourcePool(2), backend="local", telemetry=TelemetryStore())
        group.where()
        group.shutdown()
        assert torch.get_num_threads() == 3 and os.environ.get("OMP_NUM_THREADS") == omp
    finally:
        torch.set_num_threads(before)
