"""The soak bench's arithmetic (the bench itself runs in tests/test_bench_cli.py) and the ranks' allocator."""

from __future__ import annotations

import pytest

from hybridflow_lab.bench.soak import c_allocator, slope_per_100
from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup
from hybridflow_lab.telemetry import TelemetryStore
from tests.workers import Echo


def test_soak_growth_is_the_least_squares_slope_per_100_steps():
    assert slope_per_100([10 + 0.5 * step for step in range(40)]) == pytest.approx(50.0)
    assert slope_per_100([3.0] * 10) == 0.0
    assert slope_per_100([5.0]) == 0.0


@pytest.mark.ray
def test_ray_ranks_run_on_jemalloc_so_freed_memory_goes_back_to_the_os(ray_cluster):
    group = WorkerGroup(Role(Echo), ResourcePool(2), backend="ray", telemetry=TelemetryStore())
    try:
        assert [c_allocator(pid) for pid in group.pids()] == ["jemalloc", "jemalloc"]
    finally:
        group.shutdown()
