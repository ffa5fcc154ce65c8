"""Measured runs of the standard workload (bench e2e's) and the CPU profile calibrated from them
(``hybridflow-lab plan --calibrate``, ``bench placement``, tutorial 9)."""

from __future__ import annotations

import tempfile
from typing import Any

from hybridflow_lab.bench.e2e import standard_lab
from hybridflow_lab.hybrid.layout import ParallelLayout
from hybridflow_lab.placement.calibrate import StandardRun, profile_from_run
from hybridflow_lab.placement.hardware import HardwareProfile
from hybridflow_lab.placement.plan import Placement
from hybridflow_lab.placement.workload import workload_from_config
from hybridflow_lab.telemetry import Phase


def run_standard(ranks: int = 1, t: int = 1, p: int = 1, tg: int = 1, steps: int = 3, warmup: int = 1,
                 extra: tuple[str, ...] = ()) -> StandardRun:
    """Run the standard workload (bench e2e's, torch engine, plus ``extra`` overrides) on ``ranks`` actor ranks
    with training TP ``t`` in ``p`` pipeline stages and generation TP ``tg``, the overrides a placement of these
    sizes writes; the first ``warmup`` steps are not kept."""
    actor = Placement({"main": ranks}, {"actor": "main"}, {"actor": ParallelLayout(t=t, p=p, tg=tg)})
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, ranks, "torch", extra=(*actor.overrides(), *extra))
        try:
            history = [lab.step() for _ in range(warmup + steps)][warmup:]
            spans = [s for s in lab.telemetry.spans(phase=Phase.EXECUTE) if (s.step or 0) >= warmup]
            return StandardRun(history, spans, lab.placement, workload_from_config(lab.config))
        finally:
            lab.shutdown()


def calibrate(steps: int = 3, warmup: int = 1) -> tuple[HardwareProfile, dict[str, Any]]:
    """Run the standard workload on one rank and return the calibrated CPU profile and its measurements."""
    return profile_from_run(run_standard(steps=steps, warmup=warmup))
