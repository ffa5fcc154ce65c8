"""Keeping a rollout group of its own on the actor's newest weights."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow_lab.controller import WorkerGroup
from hybridflow_lab.dataflows import StepContext
from hybridflow_lab.dataflows.pending import StageFuture
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import StageSummary
from hybridflow_lab.trainer.stage_runner import StageRunner
from hybridflow_lab.trainer.stages import Stage

WEIGHTS = "policy weights"  # what gather_weights hands to sync_weights (the graph's edge)


class RolloutSync:
    """The policy version the rollout group holds, and the load that brought it there."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.last: StageFuture[dict[str, Any]] | None = None

    def reset(self) -> None:
        """The rollout group's weights are unknown (it restarted, or the actor loaded a checkpoint)."""
        self.version, self.last = None, None

    def sync(self, runner: StageRunner, step: StepContext, actor: WorkerGroup, rollout: WorkerGroup, version: int,
             lanes: tuple[str, str]) -> StageFuture[dict[str, Any]]:
        """Load the actor's weights (policy ``version``) into ``rollout`` unless it holds them: gathered on the
        actor's lane (after the updates called before), loaded on the rollout group's (after the generations
        called before), timed (``gather_weights``, ``sync_weights``). Returns the last load's numbers."""
        if self.version == version and self.last is not None:
            return self.last
        actor_lane, rollout_lane = lanes

        def gather(rows: DataBatch, summary: StageSummary) -> dict[str, torch.Tensor]:
            gathered = actor.policy_weights()[0]
            summary.columns = {WEIGHTS: {"shape": [len(gathered)], "dtype": "state_dict",
                                         "bytes": sum(t.element_size() * t.numel() for t in gathered.values())}}
            return gathered

        weights = runner.call_stage(Stage.GATHER_WEIGHTS, step, actor_lane, None, (), gather)

        def load(rows: DataBatch, summary: StageSummary) -> dict[str, Any]:
            return rollout.load_policy(weights.result(), version)[0]

        self.last = runner.call_stage(Stage.SYNC_WEIGHTS, step, rollout_lane, None, (WEIGHTS,), load, detached=True,
                                      after=weights)
        self.version = version
        return self.last
