"""Ray-only behaviour: real collectives, start-up failures, validation before start, no leaked actors."""

from __future__ import annotations

import errno
import gc
import os
import socket
import time

import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Mesh, ResourcePool, WorkerCallError, WorkerGroup, WorkerGroupClosed
from hybridflow_lab.controller.cluster import alive_actors
from hybridflow_lab.controller.host import RankHost, RankInfo
from tests.workers import BrokenInit, Echo, MeshWorker

pytestmark = pytest.mark.ray


@pytest.fixture
def no_leaks(ray_cluster):
    """Fail the test if it leaves rank processes running."""
    before = alive_actors()
    yield
    deadline = time.time() + 10  # ray.kill is asynchronous
    while alive_actors() != before and time.time() < deadline:
        time.sleep(0.1)
    assert alive_actors() == before


def test_ranks_run_at_the_controllers_priority_not_behind_every_other_process(no_leaks):
    """Ray's default nice 15 starved the ranks beside any busy process at nice 0 (a notebook kernel, a second
    pytest worker): a test of 16 s took 300 s."""
    with WorkerGroup(Echo, ResourcePool(2)) as group:
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in group.pids()] == [os.nice(0)] * 2


def test_gloo_all_reduce_over_four_ranks_and_tp_subgroups(no_leaks):
    with WorkerGroup(MeshWorker, ResourcePool(4), meshes={"train": Mesh.of(dp=2, tp=2)}) as group:
        assert group.all_reduce(1.0) == [10.0] * 4  # 1 + 2 + 3 + 4
        out = group.tp_sum(DataBatch({"x": torch.ones(4)}))
        assert out["x"].tolist() == [3.0] * 4  # tp coordinates 0 and 1, plus one each


def test_the_rendezvous_port_rank_0_names_is_already_bound_so_no_other_process_can_take_it():
    """The ranks dial the port after rank 0 names it; a port merely found free then could be taken (EADDRINUSE)."""
    info = RankInfo(group="g", rank=0, world_size=2, local_rank=0, local_world_size=2, backend="ray", meshes={})
    rank_0 = RankHost(info)
    addr, port = rank_0.endpoint()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError) as taken:
        other.bind((addr, port))
    assert taken.value.errno == errno.EADDRINUSE


def test_failure_while_peers_wait_in_a_collective_is_reported_promptly(no_leaks):
    group = WorkerGroup(MeshWorker, ResourcePool(4), meshes={"train": Mesh.of(dp=4)})
    try:
        with pytest.raises(WorkerCallError) as info:  # not after the 600 s collective timeout: pytest's is 300 s
            group.fail_while_peers_reduce(1)
        assert info.value.rank == 1 and info.value.still_running == (0, 2, 3)
        assert "were still running" in str(info.value)
    finally:
        group.shutdown()  # the peers are stuck in the all-reduce: killing them must still work


def test_groups_on_one_pool_share_its_slots_and_other_pools_are_apart(no_leaks):
    shared = ResourcePool(2)
    first, second = WorkerGroup(Echo, shared), WorkerGroup(Echo, shared)
    apart = WorkerGroup(Echo, ResourcePool(2))
    try:
        (reservation,) = set(first.placement_group())
        assert second.placement_group() == [reservation] * 2  # both groups run in the pool's reservation
        assert reservation not in apart.placement_group()
    finally:
        for group in (first, second, apart):
            group.shutdown()


def test_a_pool_gives_its_slots_back_when_its_last_group_shuts_down(ray_cluster, no_leaks):
    # On a GPU machine a slot is a whole GPU: a pool the notebook still holds must not keep it from the next group
    pool = ResourcePool(2)
    first, second = WorkerGroup(Echo, pool), WorkerGroup(Echo, pool)
    try:
        (reservation,) = set(first.placement_group())
        first.shutdown()
        assert second.scale(DataBatch({"x": torch.ones(2)}))["y"].tolist() == [2.0, 2.0]  # the colocated group runs on
        assert reservation_state(ray_cluster, reservation) == "CREATED"
    finally:
        second.shutdown()
    assert reservation_state(ray_cluster, reservation) == "REMOVED"
    with WorkerGroup(Echo, pool) as again:  # the pool reserves slots anew for its next group
        assert set(again.placement_group()).isdisjoint({reservation})


def reservation_state(ray_cluster, placement_group_id: str) -> str:
    return ray_cluster.util.placement_group_table()[placement_group_id]["state"]


def test_failing_constructor_names_the_rank_and_leaves_nothing_running(no_leaks):
    with pytest.raises(WorkerCallError) as info:
        WorkerGroup(BrokenInit, ResourcePool(2), name="broken")
    assert info.value.rank == 1 and info.value.method == "__init__"
    assert "RuntimeError: cannot start rank 1" in str(info.value)


def test_bad_layouts_fail_before_any_worker_starts(no_leaks):
    with pytest.raises(ValueError, match=r"mesh 'train' \(dp=2 x tp=4\) covers 8 ranks but the group has 4"):
        WorkerGroup(MeshWorker, ResourcePool(4), meshes={"train": Mesh.of(dp=2, tp=4)})
    with pytest.raises(ValueError, match=r"tag_rows uses Dispatch.MESH\('train'\): the group has no mesh named"):
        WorkerGroup(MeshWorker, ResourcePool(4))


def test_rebuilding_a_named_group_replaces_the_old_one(no_leaks):
    first = WorkerGroup(Echo, ResourcePool(2), name="cell")
    first_pids = {w["pid"] for w in first.where()}
    second = WorkerGroup(Echo, ResourcePool(2), name="cell")  # re-running the notebook cell
    assert first.closed and not second.closed
    with pytest.raises(WorkerGroupClosed, match=r"'cell' was shut down"):
        first.where()
    assert first_pids.isdisjoint({w["pid"] for w in second.where()})
    second.shutdown()


def test_a_rank_whose_process_died_is_named_before_the_ranks_that_failed_with_it(no_leaks):
    """Rank 0 fails as soon as rank 1's process is gone, before Ray reports the death: the error names rank 1, the
    likely cause, and lists rank 0 among the ranks that failed too."""
    group = WorkerGroup(MeshWorker, ResourcePool(2), meshes={"train": Mesh.of(dp=2)})
    try:
        with pytest.raises(WorkerCallError) as info:
            group.die_while_peers_raise(1)
        assert info.value.rank == 1 and info.value.error.startswith("the worker process died")
        assert info.value.others == (0,) and info.value.still_running == ()
    finally:
        group.shutdown()


def test_dropping_the_last_reference_stops_the_ranks(no_leaks):
    group = WorkerGroup(Echo, ResourcePool(2))
    assert len(alive_actors()) >= 2
    del group
    gc.collect()


def test_pool_too_big_for_the_cluster_says_so(ray_cluster, no_leaks):
    with pytest.raises(RuntimeError, match=r"needs 64 CPU \(64 slots x 1\) but the whole Ray cluster has 16"):
        ResourcePool(64).placement_groups()
    total = int(ray_cluster.cluster_resources()["CPU"])
    hog = ResourcePool(int(ray_cluster.available_resources()["CPU"]))  # (nearly) everything that is free
    hog.placement_groups()
    try:
        wanted = total - hog.world_size + 1  # more than can be free while the hog holds its slots, whatever else ends
        with pytest.raises(RuntimeError, match=rf"could not reserve \[{wanted}\] slots.*CPU free"):
            ResourcePool(wanted).placement_groups(timeout_s=1)
    finally:
        hog.release()


def test_a_local_rays_start_up_lines_go_to_the_log_file_not_to_the_notebook(tmp_path):
    import subprocess
    import sys

    start = ("import sys, ray; from hybridflow_lab.controller import init_cluster; "
             "init_cluster(num_cpus=2, log_file=sys.argv[1]); print(ray.is_initialized()); ray.shutdown()")
    done = subprocess.run([sys.executable, "-c", start, str(tmp_path / "ray.log")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stderr and "Token authentication" not in done.stderr
    assert "Started a local Ray instance" in (tmp_path / "ray.log").read_text()


def test_after_ray_starts_a_breakpoint_in_a_local_worker_opens_pdb_in_the_controller(tmp_path):
    import subprocess
    import sys

    # pdb reads "p self.tag" and "c" from stdin; Ray's driver hook would instead wait for an IDE to attach
    script = tmp_path / "stop.py"
    script.write_text(
        "import os\n"
        "from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, init_cluster, "
        "register\n"
        "class Stops(Worker):\n"
        "    tag = 'inside the worker'\n"
        "    @register(Dispatch.ONE_TO_ALL)\n"
        "    def stop(self):\n"
        "        breakpoint()\n"
        "        return self.rank\n"
        "before = os.environ.get('PYTHONBREAKPOINT')\n"
        "init_cluster(num_cpus=2)\n"
        "assert os.environ.get('PYTHONBREAKPOINT') == before, os.environ.get('PYTHONBREAKPOINT')\n"
        "print('ranks', WorkerGroup(Role(Stops), ResourcePool(1), backend='local').stop())\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONBREAKPOINT"}
    done = subprocess.run([sys.executable, str(script)], input="p self.tag\nc\n", capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'inside the worker'" in done.stdout and "ranks [0]" in done.stdout, done.stdout[-2000:]
