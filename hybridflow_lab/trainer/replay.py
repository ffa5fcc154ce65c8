"""Replaying a captured batch through an algorithm's dataflow: the same rollouts through GRPO, RLOO, GSPO...

A replay runs the algorithm's own dataflow function (a notebook's too) on ``ReplayStages``, the run's stages
under the replay's config with a copy of the run's state: its responses are the captured batch, the stages that
had run when it was captured are skipped (their columns are in it), the later ones run for real (log-probs on
the worker groups, KL and advantages on the controller), and the actor's update is a probe: the update's loss,
diagnostics and gradient norm for the whole batch as one optimizer step, computed on a copy of the current
policy on the controller, so the run's weights, optimizer and controllers are untouched. The critic is not
probed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow_lab.config import LabConfig
from hybridflow_lab.dataflows import Metrics, RunNeeds
from hybridflow_lab.dataflows.pending import Batch, PendingMetrics, StageFuture, resolve
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.trainer.groups import RunGroups
from hybridflow_lab.trainer.prompt_stream import PromptStream
from hybridflow_lab.trainer.run_stages import RunStages
from hybridflow_lab.trainer.run_state import RunState
from hybridflow_lab.trainer.stage_runner import StageRunner
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.workers.actor import probe_update


@dataclass
class Replayed:
    """One algorithm's pass over a captured batch: ``batch`` after its stages (``advantages``...), the probed
    update's ``metrics`` (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/grad_norm``...) and its policy loss
    per token (``token_loss``, rows x response tokens, 0 off the response mask)."""

    name: str
    overrides: tuple[str, ...]
    step: int
    stage: str
    batch: DataBatch
    metrics: Metrics
    token_loss: torch.Tensor
    skipped: list[str] = field(default_factory=list)  # the captured step's stages whose columns were reused


class ReplayError(RuntimeError):
    """A replay that cannot run: the algorithm needs what the Lab or the capture does not have."""


def check_replayable(run: RunNeeds, replay: RunNeeds, groups: RunGroups) -> None:
    """A ``ReplayError`` when the replay's algorithm needs a model this run does not have."""
    if replay.reference_model and not run.reference_model:
        raise ReplayError("this replay needs the reference policy's log-probs (a KL term) and this Lab's actor "
                          "holds no reference policy; build the Lab with a KL term (algorithm.kl_loss_coef > 0)")
    if replay.critic and "critic" not in groups.by_role:
        raise ReplayError(f"{replay.algorithm.name} needs a critic and this Lab runs none; replay it in a Lab that "
                          "runs PPO")


class ReplayStages(RunStages):
    """The run's stages under a replay's config and a copy of the run's state: the responses are ``captured``
    (taken after stage ``record["stage"]`` of step ``record["step"]``), the stages that had run are skipped, and
    ``update_actor`` probes ``policy``."""

    def __init__(self, config: LabConfig, needs: RunNeeds, groups: RunGroups, prompts: PromptStream,
                 state: RunState, runner: StageRunner, captured: DataBatch, record: dict[str, Any],
                 policy: torch.nn.Module) -> None:
        order = record["stages"]
        self.reused = order[: order.index(record["stage"]) + 1]
        super().__init__(config, needs, groups, prompts, state, runner, frozenset(Stage(s) for s in self.reused))
        self.captured, self.record, self.policy = captured, record, policy
        self.losses: dict[int, torch.Tensor] = {}

    def rollout(self) -> DataBatch:
        return self.captured

    def next_prompts(self, n: int | None = None) -> DataBatch:
        raise ReplayError("this dataflow draws prompts or generates of its own (ReMax's greedy baseline does); a "
                          "replay takes only the captured responses")

    def generate(self, prompts: Batch, greedy: bool = False, n: int | None = None) -> Batch:
        return self.next_prompts()

    def update_actor(self, batch: Batch) -> PendingMetrics:
        metrics, per_row = probe_update(self.policy, resolve(batch), self.config)
        self.losses.update(per_row)
        step = self.current_step
        return PendingMetrics(StageFuture.finished(Stage.UPDATE_ACTOR.value, step.index, step.record(metrics)))

    def update_critic(self, batch: Batch) -> PendingMetrics:
        return PendingMetrics(StageFuture.finished(Stage.UPDATE_CRITIC.value, self.current_step.index, {}))

    def run(self, name: str, overrides: tuple[str, ...]) -> Replayed:
        """The captured batch through the dataflow of the replay's algorithm."""
        final, metrics = self.needs.algorithm.dataflow(self, self.current_step)
        final = resolve(final)
        width = final["responses"].shape[1]
        token_loss = torch.stack([self.losses.get(row, torch.zeros(width)) for row in range(len(final))])
        return Replayed(name, overrides, self.record["step"], self.record["stage"], final, dict(metrics), token_loss,
                        list(self.reused))


class Replays:
    """A Lab's replays; keeps the copy of the policy they probe, gathered once per policy version."""

    def __init__(self) -> None:
        self._policy: tuple[int, torch.nn.Module] | None = None

    def forget_policy(self) -> None:
        self._policy = None

    def policy(self, run: RunStages) -> torch.nn.Module:
        """The run's current policy on the controller (float32, CPU)."""
        version = run.state.policy_version
        if self._policy is None or self._policy[0] != version:
            weights = run.group("actor").policy_weights()[0]
            self._policy = (version, policy_copy(run.config.actor.model_path, weights))
        return self._policy[1]

    def run(self, run: RunStages, captured: tuple[DataBatch, dict[str, Any]], config: LabConfig, needs: RunNeeds,
            runner: StageRunner, name: str, overrides: tuple[str, ...]) -> Replayed:
        """``captured`` (a batch and its record) through ``config``'s dataflow on ``run``'s groups, with a copy of
        its state and stages timed by ``runner`` (closed after)."""
        check_replayable(run.needs, needs, run.groups)
        stages = ReplayStages(config, needs, run.groups, run.prompts, run.state.copy(), runner, *captured,
                              self.policy(run))
        try:
            return stages.run(name, overrides)
        finally:
            runner.close()


def policy_copy(path: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A float32 model of ``path``'s architecture holding ``weights`` (the policy's, as the actor gathers them)."""
    model = load_causal_lm(path)
    model.load_state_dict(weights)
    return model
