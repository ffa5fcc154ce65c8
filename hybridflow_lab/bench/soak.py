"""``hybridflow-lab bench soak --minutes N``: the standard workload run without a break; does memory stay flat?

Steps the standard workload (bench e2e's, torch engine) for ``minutes``, checkpointing every
``save_every`` steps, and samples the resident memory of the controller and of every worker rank
after each step. Growth is the least-squares slope of resident memory over the steps after the first
``warmup`` (whose allocations are not a leak), per 100 steps, over the whole run and over its second
half. Resident memory also holds freed memory the C allocator keeps for reuse (each rank hands it back every
10 s, ``controller.memory.HeapRelease``), so the report adds what stays resident after a last release
(``controller.memory.memory_report``) and the live Python objects at the start and the end. Telemetry size is what the
run directory's telemetry and metrics files hold at the end, with the spans recorded and those the
controller keeps in memory (the newest ``TelemetryStore.max_spans``; spans.jsonl has them all).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from hybridflow_lab.bench.e2e import standard_lab
from hybridflow_lab.controller.memory import memory_report, resident_mb

TELEMETRY_FILES = ("spans.jsonl", "metrics.jsonl", "samples.jsonl")


def slope_per_100(values: list[float]) -> float:
    """Least-squares growth of ``values`` (one per step) per 100 steps; 0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    steps = range(len(values))
    mean_step, mean_value = statistics.fmean(steps), statistics.fmean(values)
    covariance = sum((s - mean_step) * (v - mean_value) for s, v in zip(steps, values, strict=True))
    return 100 * covariance / sum((s - mean_step) ** 2 for s in steps)


def _growth(series: list[list[float]]) -> tuple[float, float]:
    """The largest growth per 100 steps among ``series``, over all steps and over the second half."""
    return (round(max(slope_per_100(s) for s in series), 2),
            round(max(slope_per_100(s[len(s) // 2:]) for s in series), 2))


def run(minutes: float = 10.0, save_every: int = 10, ranks: int = 2, warmup: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, ranks, "torch", extra=(f"trainer.save_every={save_every}",
                                                       "trainer.keep_checkpoints=2"))
        try:
            for _ in range(warmup):
                lab.step()
            workers = lab.actor.pids()
            objects_start = [m["python_objects"] for m in [memory_report(), *lab.actor.memory()]]
            controller, worker_rss = [resident_mb()], [[resident_mb(pid)] for pid in workers]
            step_s = []
            deadline = time.monotonic() + minutes * 60
            while time.monotonic() < deadline:
                step_s.append(lab.step()["timing_s/step"])
                controller.append(resident_mb())
                for samples, pid in zip(worker_rss, workers, strict=True):
                    samples.append(resident_mb(pid))
            released = [memory_report(release=True), *lab.actor.memory(release=True)]
            checkpoints = sorted(p.name for p in (lab.run_dir / "checkpoints").glob("step_*"))
            telemetry_bytes = sum((lab.run_dir / name).stat().st_size for name in TELEMETRY_FILES
                                  if (lab.run_dir / name).is_file())
            spans_recorded, spans_in_memory = lab.telemetry.recorded, len(lab.telemetry)
        finally:
            lab.shutdown()
    controller_growth, controller_late = _growth([controller])
    worker_growth, worker_late = _growth(worker_rss)
    return {
        "bench": "soak", "workload": "standard", "minutes": minutes, "steps": len(step_s), "ranks": ranks,
        "save_every": save_every, "checkpoints_kept": checkpoints,
        "step_s_median": round(statistics.median(step_s), 3) if step_s else None,
        "controller_rss_mb_start": round(controller[0], 1), "controller_rss_mb_end": round(controller[-1], 1),
        "controller_rss_mb_growth_per_100_steps": controller_growth,
        "controller_rss_mb_growth_per_100_steps_second_half": controller_late,
        "worker_rss_mb_start": [round(s[0], 1) for s in worker_rss],
        "worker_rss_mb_end": [round(s[-1], 1) for s in worker_rss],
        "worker_rss_mb_growth_per_100_steps": worker_growth,
        "worker_rss_mb_growth_per_100_steps_second_half": worker_late,
        "rss_mb_after_release": {"controller": round(released[0]["rss_mb"], 1),
                                 "workers": [round(m["rss_mb"], 1) for m in released[1:]]},
        "python_objects": {"start": [int(n) for n in objects_start],
                           "end": [int(m["python_objects"]) for m in released]},
        "telemetry_bytes": telemetry_bytes, "telemetry_spans_recorded": spans_recorded,
        "telemetry_spans_in_memory": spans_in_memory,
    }
