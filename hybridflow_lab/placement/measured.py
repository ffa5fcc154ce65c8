"""A Lab's measured step seconds in the simulator's stages, to set beside its predictions."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

LAB_STAGES = {"generation": ("generate",), "preparation": ("old_log_prob", "ref", "values"),
              "training": ("update_actor", "update_critic")}


def stage_seconds(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Median seconds per simulator stage and per step of a Lab's step metrics (``timing_s/<stage>``)."""
    seconds = {stage: statistics.median(sum(m.get(f"timing_s/{s}", 0.0) for s in names) for m in history)
               for stage, names in LAB_STAGES.items()}
    seconds["step"] = statistics.median(m["timing_s/step"] for m in history)
    return seconds
