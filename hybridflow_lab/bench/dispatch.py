"""``hybridflow-lab bench dispatch``: the cost of a registered call next to a raw Ray call.

For 1, 2 and 4 ranks and payloads of 0 B, 1 MB and 16 MB, each transfer protocol moves a
float32 payload to the ranks and back (every rank echoes what it received). The raw
baseline does the same with plain Ray actors in the same run: it splits and
concatenates torch tensors by hand, and stores a payload sent to several actors once.
``ray_numpy_ms_p50`` is the same raw call with numpy arrays (Ray's zero-copy path).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Dispatch, Mesh, ResourcePool, Worker, WorkerGroup, init_cluster, register
from hybridflow_lab.telemetry import TelemetryStore

ROWS = 64
MODES = ("ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "MESH")


class EchoWorker(Worker):
    """Returns what it receives, under each transfer protocol."""

    @register(Dispatch.ONE_TO_ALL)
    def echo_all(self, batch: DataBatch) -> DataBatch:
        return batch

    @register(Dispatch.ALL_TO_ALL)
    def echo_each(self, batch: DataBatch) -> DataBatch:
        return batch

    @register(Dispatch.DP_COMPUTE)
    def echo_dp(self, batch: DataBatch) -> DataBatch:
        return batch

    @register(Dispatch.MESH("bench"))
    def echo_mesh(self, batch: DataBatch) -> DataBatch:
        return batch


@ray.remote(num_cpus=0)
class RawEcho:
    def echo(self, value: Any) -> Any:
        return value


def bench_mesh(workers: int) -> Mesh:
    """dp x tp = workers/2 x 2 when possible, so MESH replicates along tp."""
    return Mesh.of(dp=workers // 2, tp=2) if workers >= 2 else Mesh.of(dp=1)


def our_call(group: WorkerGroup, mode: str, payload: torch.Tensor) -> Callable[[], Any]:
    batch = DataBatch({"x": payload})
    if mode == "ONE_TO_ALL":
        return lambda: group.echo_all(batch)
    if mode == "ALL_TO_ALL":
        parts = batch.chunk(group.world_size)
        return lambda: group.echo_each(parts)
    if mode == "DP_COMPUTE":
        return lambda: group.echo_dp(batch)
    return lambda: group.echo_mesh(batch)


def raw_call(actors: list[Any], mode: str, payload: Any, mesh: Mesh) -> Callable[[], Any]:
    """The hand-written Ray equivalent of ``our_call`` (torch tensors or numpy arrays)."""
    cat = torch.cat if isinstance(payload, torch.Tensor) else np.concatenate
    n = len(actors)

    def chunks(parts: int) -> list[Any]:
        return list(payload.chunk(parts)) if isinstance(payload, torch.Tensor) else np.split(payload, parts)

    if mode == "ONE_TO_ALL":
        return lambda: ray.get([a.echo.remote(ref) for ref in [ray.put(payload)] for a in actors])
    if mode == "ALL_TO_ALL":
        return lambda: ray.get([a.echo.remote(c) for a, c in zip(actors, chunks(n), strict=True)])
    if mode == "DP_COMPUTE":
        return lambda: cat(ray.get([a.echo.remote(c) for a, c in zip(actors, chunks(n), strict=True)]))
    dp = mesh.axis_size("dp")
    collect = {mesh.rank_at(dp=i) for i in range(dp)}

    def mesh_call() -> Any:
        refs = [ray.put(c) for c in chunks(dp)]
        outs = ray.get([a.echo.remote(refs[mesh.coord(r, "dp")]) for r, a in enumerate(actors)])
        return cat([o for r, o in enumerate(outs) if r in collect])

    return mesh_call


def median_ms(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median wall time per call, interleaving the contenders so that drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(workers: tuple[int, ...] = (1, 2, 4), payloads: tuple[int, ...] = (0, 1 << 20, 16 << 20),
        repeats: int | None = None) -> dict[str, Any]:
    """Run the benchmark; returns ``{"results": [{mode, workers, payload_bytes, ...}], ...}``."""
    init_cluster()
    rows = []
    for n in workers:
        mesh = bench_mesh(n)
        group = WorkerGroup(EchoWorker, ResourcePool(n), name=f"bench-{n}", meshes={"bench": mesh},
                            telemetry=TelemetryStore(max_spans=1000))
        actors = [RawEcho.remote() for _ in range(n)]
        try:
            for size in payloads:
                payload = torch.randn(ROWS, size // (4 * ROWS))
                count = repeats or (30 if size <= 1 << 20 else 10)
                for mode in MODES:
                    times = median_ms({
                        "ours": our_call(group, mode, payload),
                        "ray": raw_call(actors, mode, payload, mesh),
                        "ray_numpy": raw_call(actors, mode, payload.numpy(), mesh),
                    }, count)
                    rows.append({
                        "mode": mode, "workers": n, "payload_bytes": size,
                        "ours_ms_p50": round(times["ours"], 3), "ray_ms_p50": round(times["ray"], 3),
                        "ratio": round(times["ours"] / times["ray"], 3),
                        "ray_numpy_ms_p50": round(times["ray_numpy"], 3),
                        "ratio_vs_numpy": round(times["ours"] / times["ray_numpy"], 3),
                    })
        finally:
            group.shutdown()
            for actor in actors:
                ray.kill(actor)
    return {
        "bench": "dispatch",
        "round_trip": "payload to the ranks and back; p50 over repeats after 2 warm-up calls",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
                 "torch": torch.__version__},
        "results": rows,
    }

