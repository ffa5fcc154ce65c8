"""What a dataflow works with: the stages it calls (the Lab provides them) and the step it runs in.

A dataflow is a function ``(lab, step) -> (batch, metrics)``. ``lab`` is anything with the ``Stages`` methods
(the ``Lab``: each stage moves a ``DataBatch`` through a worker group or computes on the controller; in an
overlapped step it returns a ``PendingBatch`` at once and runs when its inputs exist); ``step``
is the ``StepContext`` every stage of this iteration records into: the metrics it reports, its seconds, and
the seeds its random draws take.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hybridflow_lab.seeds import derive_seed

if TYPE_CHECKING:
    from concurrent.futures import Future

    from hybridflow_lab.algorithms.safe_rlhf import LagrangeMultiplier
    from hybridflow_lab.config import LabConfig
    from hybridflow_lab.dataflows.algorithm import RunNeeds
    from hybridflow_lab.dataflows.pending import Batch
    from hybridflow_lab.protocol import DataBatch

Metrics = dict[str, float]


@dataclass
class StepContext:
    """One iteration of a run: its index, the metrics and seconds its stages report, the seeds they draw.

    ``seed(stage)`` gives the n-th draw of ``stage`` in this step a seed of its own, derived from the run's
    seed, the step index, the stage and n (``hybridflow_lab.seeds``): replaying a step from a checkpoint draws
    the same samples, whichever stages ran before it in this process.
    """

    index: int
    run_seed: int
    metrics: Metrics = field(default_factory=dict)  # with each stage's seconds as timing_s/<stage>
    draws: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # overlapped stages

    def seed(self, stage: str) -> int:
        """A fresh seed for the next random draw of ``stage`` in this step."""
        count = self.draws.get(stage, 0)
        self.draws[stage] = count + 1
        return derive_seed(self.run_seed, self.index, stage, count)

    def record(self, metrics: Mapping[str, float]) -> Metrics:
        """Add ``metrics`` to the step's (a later value of a key replaces an earlier one); returns them."""
        with self._lock:
            self.metrics.update(metrics)
        return dict(metrics)

    def count(self, key: str, amount: float) -> None:
        """Add ``amount`` to the step's metric ``key``: events counted over the step (reward failures), or the
        seconds of a stage called more than once (``timing_s/<stage>``)."""
        with self._lock:
            self.metrics[key] = self.metrics.get(key, 0) + amount


class Stages(Protocol):
    """The stages a dataflow calls (``hybridflow_lab.trainer.Lab`` implements them; see its docstrings)."""

    config: LabConfig
    needs: RunNeeds
    lagrange: LagrangeMultiplier

    def next_prompts(self, n: int | None = None) -> DataBatch: ...
    def generate(self, prompts: Batch, greedy: bool = False, n: int | None = None) -> Batch: ...
    def reward(self, batch: Batch) -> Batch: ...
    def shape_rewards(self, batch: Batch) -> Batch: ...
    def old_log_prob(self, batch: Batch) -> Batch: ...
    def ref_log_prob(self, batch: Batch) -> Batch: ...
    def values(self, batch: Batch) -> Batch: ...
    def kl_penalty(self, batch: Batch) -> Batch: ...
    def advantages(self, batch: Batch, estimator: str | None = None, scores: str = "scores") -> Batch: ...
    def update_critic(self, batch: Batch) -> Metrics | Future[Metrics]: ...
    def update_actor(self, batch: Batch) -> Metrics | Future[Metrics]: ...
