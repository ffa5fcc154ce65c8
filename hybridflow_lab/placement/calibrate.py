"""This machine's CPU profile, measured from the telemetry of real runs (``hybridflow-lab plan --calibrate`` runs
them: ``bench.calibration``).

One actor rank runs a few steps of the standard workload (bench e2e's); its spans give the forward
and training FLOP rates (FLOPs the stage must do over the rank's execute seconds), the decoding
step's fixed cost, the per-call dispatch cost and the controller's own time per step. Pairs of
ranks then time gloo all-reduces, with twice as many ranks as cores busy (how tensor-parallel runs
share this machine), for the collective latency and bandwidth. Every rank runs one thread, so a
device is one core and ``cores`` is this machine's core count.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, register
from hybridflow_lab.placement.hardware import PROFILES, HardwareProfile
from hybridflow_lab.placement.plan import Placement
from hybridflow_lab.placement.workload import Workload
from hybridflow_lab.telemetry import Span

MODEL_STAGES = {"generate": "generate_sequences", "ref": "compute_ref_log_prob", "update_actor": "update_actor"}


class CollectiveProbe(Worker):
    """Times gloo all-reduces inside pairs of ranks, every pair at once and with a little compute between
    them, as tensor-parallel decoding does (a peer that the OS has descheduled makes the other wait)."""

    def __init__(self) -> None:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, self.world_size, 2)]
        self.pair = pairs[self.rank // 2]
        self.left, self.right = torch.randn(32, 256), torch.randn(256, 1024)  # about a decoding layer's matmul

    def _loop_s(self, tensor: torch.Tensor | None, repeats: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            self.left @ self.right
            if tensor is not None:
                dist.all_reduce(tensor, group=self.pair)
        return (time.perf_counter() - start) / repeats

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_s(self, numel: int, repeats: int) -> float:
        """Seconds one all-reduce of ``numel`` floats adds to an iteration of compute."""
        tensor = torch.zeros(numel)
        self._loop_s(tensor, 2)
        return self._loop_s(tensor, repeats) - self._loop_s(None, repeats)


def collective_rates(ranks: int, repeats: int = 50) -> tuple[float, float]:
    """(latency seconds, bytes/s per rank) of 2-rank gloo all-reduces with ``ranks`` ranks busy: 1 element, 4 MB."""
    group = WorkerGroup(Role(CollectiveProbe), ResourcePool(ranks), name="calibrate-collectives")
    try:
        latency = max(group.all_reduce_s(1, repeats))
        numel = 1 << 20
        large = max(group.all_reduce_s(numel, max(3, repeats // 10)))
    finally:
        group.shutdown()
    return latency, numel * 4 / max(large - latency, 1e-9)  # a 2-rank ring all-reduce moves the tensor once


@dataclass(frozen=True)
class StandardRun:
    """Measured steps of the standard workload on one placement: their metrics, the ranks' execute spans
    (of those steps only) and what ran."""

    history: list[dict[str, float]]
    spans: list[Span]
    placement: Placement
    workload: Workload

    @staticmethod
    def merged(runs: list[StandardRun]) -> StandardRun:
        """One run holding the steps of several runs of the same setting."""
        return StandardRun([m for r in runs for m in r.history], [s for r in runs for s in r.spans],
                           runs[0].placement, runs[0].workload)


def profile_from_run(run: StandardRun) -> tuple[HardwareProfile, dict[str, Any]]:
    """The calibrated CPU profile from a one-rank run of the standard workload, and the measurements behind it."""
    if run.placement.size_of("actor").world_size != 1:
        raise ValueError("calibration needs a run of the standard workload on one actor rank")
    execute = {stage: statistics.median(s.duration for s in run.spans if s.name == method)
               for stage, method in MODEL_STAGES.items()}
    timing = {stage: statistics.median(m.get(f"timing_s/{stage}", 0.0) for m in run.history)
              for stage in (*MODEL_STAGES, "step")}
    workload = run.workload
    spec, length = workload.models["actor"], workload.sequence_tokens
    forward_flops = workload.sequences * length * spec.flops_per_token(length // 2)
    infer_rate = forward_flops / execute["ref"]
    train_rate = 3 * forward_flops / execute["update_actor"]
    prompt, response = workload.prompt_tokens, workload.response_tokens
    prefill_s = workload.sequences * prompt * spec.flops_per_token(prompt // 2) / infer_rate
    decode_compute_s = workload.sequences * spec.flops_per_token(prompt + response // 2) / infer_rate
    decode_step_s = (execute["generate"] - prefill_s) / response
    cores = os.cpu_count() or 1
    latency, bandwidth = collective_rates(2 * cores)
    profile = replace(
        PROFILES["cpu"], name="cpu-calibrated", flops=infer_rate, infer_efficiency=1.0,
        train_efficiency=train_rate / infer_rate, bandwidth_efficiency=1.0,
        decode_step_overhead_s=max(0.0, decode_step_s - decode_compute_s),
        call_overhead_s=statistics.median(timing[s] - execute[s] for s in MODEL_STAGES),
        step_overhead_s=statistics.median(m["timing_s/step"] - sum(m.get(f"timing_s/{s}", 0.0) for s in MODEL_STAGES)
                                          for m in run.history),
        collective_latency_s=latency, intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
        cores=cores,
    )
    measured = {"execute_s": execute, "stage_s": timing, "forward_gflop": forward_flops / 1e9,
                "decode_step_s": decode_step_s, "decode_compute_s": decode_compute_s,
                "all_reduce_latency_s": latency, "all_reduce_bytes_per_s": bandwidth}
    return profile, measured
