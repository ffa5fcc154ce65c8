"""``hybridflow-lab bench placement``: the simulator's per-step predictions against measured steps on this machine.

Runs the standard workload (bench e2e's, torch engine) under several placements and parallel sizes on
up to 4 CPU ranks, then calibrates the CPU profile (``placement.calibrate``), and compares the
median measured step with the simulator's prediction for the same placement (stages called one after
another, as the Lab does). Reports each error and whether the predicted ranking matches the measured
(strictly, and for settings measured more than 5% apart).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import asdict
from typing import Any

from hybridflow_lab.bench.e2e import standard_lab
from hybridflow_lab.controller import init_cluster
from hybridflow_lab.placement.calibrate import calibrate
from hybridflow_lab.placement.predict import predict
from hybridflow_lab.placement.workload import workload_from_config

# (label, actor ranks, training TP t, generation TP tg)
SETTINGS = (("d1", 1, 1, 1), ("d2", 2, 1, 1), ("d4", 4, 1, 1), ("t2 d2 tg2", 4, 2, 2), ("t2 d2 tg1", 4, 2, 1))
TIE = 0.05  # measured steps closer than this fraction are a tie (run-to-run spread on this machine)
LAB_STAGES = {"generation": ("generate",), "preparation": ("old_log_prob", "ref", "values"),
              "training": ("update_actor", "update_critic")}


def measure(ranks: int, t: int, tg: int, steps: int, warmup: int) -> tuple[dict[str, float], Any]:
    """Median seconds per step and per simulator stage of the standard workload, and the Lab's placement."""
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, ranks, "torch", extra=(f"actor.engine.tensor_parallel={t}",
                                                        f"rollout.tensor_parallel={tg}"))
        try:
            history = [lab.step() for _ in range(warmup + steps)][warmup:]
            placement, workload = lab.placement, workload_from_config(lab.config)
        finally:
            lab.shutdown()
    seconds = {stage: statistics.median(sum(m.get(f"timing_s/{s}", 0.0) for s in names) for m in history)
               for stage, names in LAB_STAGES.items()}
    seconds["step"] = statistics.median(m["timing_s/step"] for m in history)
    return seconds, (placement, workload)


def run(steps: int = 4, warmup: int = 2, settings: tuple[tuple[str, int, int, int], ...] = SETTINGS,
        calibration_steps: int = 5) -> dict[str, Any]:
    init_cluster()
    measured = {label: measure(ranks, t, tg, steps, warmup) for label, ranks, t, tg in settings}
    profile, calibration = calibrate(steps=calibration_steps, warmup=warmup)  # after Ray's start-up work settles
    rows = []
    for label, ranks, t, tg in settings:
        seconds, (placement, workload) = measured[label]
        plan = predict(placement, workload, profile, concurrent=False)
        rows.append({"setting": label, "ranks": ranks, "t": t, "tg": tg,
                     "predicted_s": round(plan.total_s, 3), "measured_s": round(seconds["step"], 3),
                     "error": round(plan.total_s / seconds["step"] - 1, 3),
                     "predicted_stage_s": {k: round(v, 3) for k, v in plan.stage_s.items()},
                     "measured_stage_s": {k: round(v, 3) for k, v in seconds.items() if k != "step"}})
    by_prediction = [r["setting"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    by_measurement = [r["setting"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    swapped = misordered_pairs(rows)
    return {"bench": "placement", "workload": "standard", "steps": steps, "profile": asdict(profile),
            "calibration": calibration, "results": rows, "ranking_predicted": by_prediction,
            "ranking_measured": by_measurement, "ranking_matches": by_prediction == by_measurement,
            "misordered_pairs_beyond_noise": swapped, "max_abs_error": max(abs(r["error"]) for r in rows),
            "goal_met": not swapped and all(abs(r["error"]) <= 0.3 for r in rows)}


def misordered_pairs(rows: list[dict[str, Any]], noise: float = TIE) -> list[tuple[str, str]]:
    """Pairs of settings the prediction orders against the measurement, among those measured more than
    ``noise`` apart (closer ones are ties: their order changes from run to run)."""
    swapped = []
    for a, b in itertools.combinations(rows, 2):
        apart = abs(a["measured_s"] - b["measured_s"]) > noise * min(a["measured_s"], b["measured_s"])
        if apart and (a["measured_s"] < b["measured_s"]) != (a["predicted_s"] < b["predicted_s"]):
            swapped.append((a["setting"], b["setting"]))
    return swapped
