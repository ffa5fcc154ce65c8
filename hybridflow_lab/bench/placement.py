"""``hybridflow-lab bench placement``: the simulator's per-step predictions against measured steps on this machine.

Runs the standard workload (bench e2e's, torch engine) under several placements and parallel sizes on
up to 4 CPU ranks, pipeline stages for the actor's training among them (p2: two stages, gathered into
whole models for generation), in rounds that alternate the order of the settings (so that a machine
getting slower or faster over the run does not favour the settings measured first). The one-rank
setting's steps calibrate the CPU profile (``placement.calibrate``); every other setting is predicted
from that profile alone. Reports each prediction's error and whether the predicted ranking matches the measured one,
strictly and for settings that are apart beyond the run-to-run noise.

Then PPO (a critic besides the actor, one rank each) in the paper's layouts, each run with its stages in
order and overlapped (``trainer.overlap``): ``colocate`` puts the critic on the actor's pool, so its
stages take turns with the actor's either way; ``split`` gives it a pool of its own, where its values and
update run beside the actor's reference pass and update. (``standalone`` is ``split`` here: the reference
and a reward model run inside the actor's ranks.) Predictions use the same profile, overlapped sets
taking the slowest one (``d_cost``'s max) and sequential ones adding up.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict
from typing import Any

from hybridflow_lab.bench.calibration import run_standard
from hybridflow_lab.controller import init_cluster
from hybridflow_lab.placement.calibrate import StandardRun, profile_from_run
from hybridflow_lab.placement.hardware import HardwareProfile
from hybridflow_lab.placement.measured import stage_seconds
from hybridflow_lab.placement.predict import predict

Setting = tuple[str, int, int, int, int]  # (label, actor ranks, training TP t, pipeline stages p, generation TP tg)
# the first is the calibration run
SETTINGS: tuple[Setting, ...] = (
    ("d1", 1, 1, 1, 1), ("d2", 2, 1, 1, 1), ("d4", 4, 1, 1, 1), ("t2 d2 tg2", 4, 2, 1, 2), ("t2 d2 tg1", 4, 2, 1, 1),
    ("p2 d1", 2, 1, 2, 1), ("p2 d2", 4, 1, 2, 1), ("p2 t2 tg2", 4, 2, 2, 2), ("p2 t2 tg1", 4, 2, 2, 1))
TIE = 0.05  # measured steps closer than this fraction are a tie
PPO_LAYOUTS = (("colocate", "main"), ("split", "critic"))  # (layout, the critic's pool); the actor's is main
OVERLAP_GOAL = 1.3  # split PPO: sequential step seconds over overlapped ones


def run(steps: int = 3, warmup: int = 2, rounds: int = 2,
        settings: tuple[Setting, ...] = SETTINGS,
        layouts: tuple[tuple[str, str], ...] = PPO_LAYOUTS) -> dict[str, Any]:
    init_cluster()
    runs: dict[str, list[StandardRun]] = {label: [] for label, *_ in settings}
    for round_index in range(rounds):
        for label, ranks, t, p, tg in settings if round_index % 2 == 0 else settings[::-1]:
            runs[label].append(run_standard(ranks, t, p, tg, steps, warmup))
    calibration_label = settings[0][0]
    profile, calibration = profile_from_run(StandardRun.merged(runs[calibration_label]))
    rows = []
    for label, ranks, t, p, tg in settings:
        run_ = StandardRun.merged(runs[label])
        seconds = stage_seconds(run_.history)
        per_round = [stage_seconds(r.history)["step"] for r in runs[label]]
        plan = predict(run_.placement, run_.workload, profile, concurrent=False)
        rows.append({"setting": label, "ranks": ranks, "t": t, "p": p, "tg": tg,
                     "calibration": label == calibration_label,
                     "predicted_s": round(plan.total_s, 3), "measured_s": round(seconds["step"], 3),
                     "measured_rounds_s": [round(s, 3) for s in per_round],
                     "error": round(plan.total_s / seconds["step"] - 1, 3),
                     "predicted_stage_s": {k: round(v, 3) for k, v in plan.stage_s.items()},
                     "measured_stage_s": {k: round(v, 3) for k, v in seconds.items() if k != "step"}})
    by_prediction = [r["setting"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    by_measurement = [r["setting"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    swapped = misordered_pairs(rows)
    held_out = [abs(r["error"]) for r in rows if not r["calibration"]]
    ppo = ppo_layouts(profile, layouts, steps, warmup, rounds)
    return {"bench": "placement", "workload": "standard", "steps": steps, "rounds": rounds,
            "profile": asdict(profile), "calibration": calibration, "results": rows,
            "ranking_predicted": by_prediction, "ranking_measured": by_measurement,
            "ranking_matches": by_prediction == by_measurement, "misordered_pairs_beyond_noise": swapped,
            "max_abs_error": max(abs(r["error"]) for r in rows),
            "max_abs_error_held_out": max(held_out, default=0.0),
            "goal_met": not swapped and all(abs(r["error"]) <= 0.3 for r in rows), **ppo}


def ppo_layouts(profile: HardwareProfile, layouts: tuple[tuple[str, str], ...], steps: int, warmup: int,
                rounds: int) -> dict[str, Any]:
    """PPO's step in each layout, sequential and overlapped, measured in alternating rounds and predicted."""
    modes = [(layout, pool, overlap) for layout, pool in layouts for overlap in (False, True)]
    runs: dict[tuple[str, bool], list[StandardRun]] = {(layout, overlap): [] for layout, _, overlap in modes}
    for round_index in range(rounds):
        for layout, pool, overlap in modes if round_index % 2 == 0 else modes[::-1]:
            extra = ("algorithm.name=ppo", "critic.ranks=1", f"critic.pool={pool}", "critic.engine.backend=torch",
                     f"trainer.overlap={str(overlap).lower()}")
            runs[layout, overlap].append(run_standard(steps=steps, warmup=warmup, extra=extra))
    rows = []
    for layout, _ in layouts:
        sequential, overlapped = (StandardRun.merged(runs[layout, overlap]) for overlap in (False, True))
        measured = {name: stage_seconds(r.history) for name, r in (("sequential", sequential),
                                                                    ("overlapped", overlapped))}
        predicted = {name: predict(overlapped.placement, overlapped.workload, profile, concurrent=concurrent)
                     for name, concurrent in (("sequential", False), ("overlapped", True))}
        rows.append({"layout": layout, "placement": overlapped.placement.pool_summary(),
                     "sequential_s": round(measured["sequential"]["step"], 3),
                     "overlapped_s": round(measured["overlapped"]["step"], 3),
                     "speedup": round(measured["sequential"]["step"] / measured["overlapped"]["step"], 3),
                     "predicted_s": round(predicted["overlapped"].total_s, 3),
                     "predicted_sequential_s": round(predicted["sequential"].total_s, 3),
                     "error": round(predicted["overlapped"].total_s / measured["overlapped"]["step"] - 1, 3),
                     "measured_rounds_s": [round(stage_seconds(r.history)["step"], 3)
                                           for r in runs[layout, True]],
                     "sequential_rounds_s": [round(stage_seconds(r.history)["step"], 3)
                                             for r in runs[layout, False]],
                     "predicted_stage_s": {k: round(v, 3) for k, v in predicted["overlapped"].stage_s.items()},
                     "measured_stage_s": {k: round(v, 3) for k, v in measured["overlapped"].items() if k != "step"}})
    ranked = [{"setting": r["layout"], "measured_s": r["overlapped_s"], "predicted_s": r["predicted_s"],
               "measured_rounds_s": r["measured_rounds_s"]} for r in rows]
    split = next((r for r in rows if r["layout"] == "split"), None)
    return {"ppo_layouts": rows,
            "ppo_ranking_predicted": [r["layout"] for r in sorted(rows, key=lambda r: r["predicted_s"])],
            "ppo_ranking_measured": [r["layout"] for r in sorted(rows, key=lambda r: r["overlapped_s"])],
            "ppo_misordered_pairs_beyond_noise": misordered_pairs(ranked),
            "overlap_goal": OVERLAP_GOAL, "overlap_goal_met": split is not None and split["speedup"] >= OVERLAP_GOAL}


def misordered_pairs(rows: list[dict[str, Any]], noise: float = TIE) -> list[tuple[str, str]]:
    """Pairs of settings the prediction orders against the measurement, among those measured apart: more
    than ``noise`` apart, and (where a setting was measured in several rounds) with no round of the faster
    one slower than a round of the other."""
    swapped = []
    for a, b in itertools.combinations(rows, 2):
        fast, slow = sorted((a, b), key=lambda r: r["measured_s"])
        apart = slow["measured_s"] - fast["measured_s"] > noise * fast["measured_s"] and \
            max(fast.get("measured_rounds_s") or [0.0]) < min(slow.get("measured_rounds_s") or [float("inf")])
        if apart and fast["predicted_s"] > slow["predicted_s"]:
            swapped.append((a["setting"], b["setting"]))
    return swapped
