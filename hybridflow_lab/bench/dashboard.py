"""``hybridflow-lab bench dashboard``: does a live notebook dashboard slow training?

Runs the standard e2e workload in alternating blocks of steps without and with ``dashboard(lab)``
attached (redrawing every ``interval_s`` from its own thread) and compares the median step times.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from hybridflow_lab.bench.e2e import standard_lab
from hybridflow_lab.ui import dashboard


def run(blocks: int = 3, steps_per_block: int = 4, warmup: int = 2, interval_s: float = 2.0,
        ranks: int = 2, engine: str = "deepspeed", backend: str = "ray") -> dict[str, Any]:
    plain: list[float] = []
    watched: list[float] = []
    refreshes = 0
    redraw_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        lab = standard_lab(tmp, ranks, engine, backend)
        try:
            for _ in range(warmup):
                lab.step()
            for _ in range(blocks):
                plain += [lab.step()["timing_s/step"] for _ in range(steps_per_block)]
                view = dashboard(lab, interval_s=interval_s)
                watched += [lab.step()["timing_s/step"] for _ in range(steps_per_block)]
                view.close()
                refreshes += view.refreshes
                redraw_s += view.refresh_seconds
        finally:
            lab.shutdown()
    plain_s, watched_s = statistics.median(plain), statistics.median(watched)
    return {
        "bench": "dashboard", "workload": "standard", "interval_s": interval_s, "steps_each": len(plain),
        "step_s_median_without": round(plain_s, 3), "step_s_median_with": round(watched_s, 3),
        "overhead_fraction": round(watched_s / plain_s - 1, 4), "redraws": refreshes,
        "redraw_s_total": round(redraw_s, 3), "watched_s_total": round(sum(watched), 3),
    }
