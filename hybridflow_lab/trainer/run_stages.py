"""The stages of an RL iteration on a run's worker groups: what a dataflow calls (``dataflows.Stages``).

Each stage is a short method on a batch: it names the group or the controller computation that runs it, the
columns it reads and those it writes; ``StageRunner`` times it and, inside ``overlapped()``, runs it on its
lane. The computations themselves are in ``dataflows.computations`` and the workers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from hybridflow_lab.algorithms.masked import token_level
from hybridflow_lab.algorithms.registry import get_advantage_estimator, get_policy_loss
from hybridflow_lab.algorithms.safe_rlhf import LagrangeMultiplier
from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import WorkerGroup
from hybridflow_lab.dataflows import Metrics, RunNeeds, StepContext
from hybridflow_lab.dataflows.computations import advantage_columns, kl_penalised_rewards, shaped_scores, staleness
from hybridflow_lab.dataflows.pending import Batch, PendingMetrics, resolve
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import StageSummary
from hybridflow_lab.trainer.groups import RunGroups
from hybridflow_lab.trainer.prompt_stream import PromptStream
from hybridflow_lab.trainer.rollouts_ahead import RolloutsAhead
from hybridflow_lab.trainer.run_state import RunState
from hybridflow_lab.trainer.stage_runner import StageRunner, lane_of
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.trainer.task_setup import TaskSetup
from hybridflow_lab.trainer.weight_sync import RolloutSync
from hybridflow_lab.workers import rule_scores
from hybridflow_lab.workers.reward_guard import RewardGuard

TRAINING_COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
PROMPT_COLUMNS = ("input_ids", "attention_mask")  # what generation reads of the prompts (the graph's edge)
GENERATED_COLUMNS = ("prompts", *TRAINING_COLUMNS, "rollout_log_probs", "response_text", "policy_version")


class RunStages:
    """The stages of ``config``'s run on ``groups``, recording into ``state``'s step; ``skipped``: stages that hand
    their batch back unchanged (a replay's, whose columns the captured batch has)."""

    def __init__(self, config: LabConfig, needs: RunNeeds, groups: RunGroups, prompts: PromptStream,
                 state: RunState, runner: StageRunner, skipped: frozenset[Stage] = frozenset()) -> None:
        self.config, self.needs, self.groups, self.prompts = config, needs, groups, prompts
        self.state, self.runner, self.skipped = state, runner, skipped
        self.rollout_sync = RolloutSync()
        self.ahead = RolloutsAhead(config.rollout.max_staleness, prompts, self._draw_ahead, config.seed)
        self._step: StepContext | None = None

    @property
    def task(self) -> TaskSetup:
        return self.prompts.task

    @property
    def lagrange(self) -> LagrangeMultiplier:
        return self.state.lagrange

    @property
    def reward_guard(self) -> RewardGuard:
        return RewardGuard.from_config(self.config.task)

    @property
    def current_step(self) -> StepContext:
        """The step the stages record into: the running stage's, else step ``state.step_index``."""
        running = self.runner.current_step()
        if running is not None:
            return running
        if self._step is None or self._step.index != self.state.step_index:
            self._step = StepContext(self.state.step_index, self.config.seed)
        return self._step

    def begin_step(self) -> StepContext:
        """A fresh step ``state.step_index`` (holding the seconds of its generation when that ran ahead)."""
        index = self.state.step_index
        self._step = self.ahead.context(index) or StepContext(index, self.config.seed)
        return self._step

    def group(self, role: str) -> WorkerGroup:
        return self.groups.get(role, "the Lab's worker groups are not running; call lab.start()")

    @property
    def critic(self) -> WorkerGroup:
        return self.groups.get("critic", f"algorithm {self.config.algorithm.name!r} runs without a critic")

    def timed(self, stage: Stage) -> AbstractContextManager[StageSummary]:
        """Time a controller-side stage of the current step (``timing_s/<stage>``, a STAGE span)."""
        return self.runner.timed(stage, self.current_step)

    def _lane(self, role: str | None) -> str:
        """The lane of ``role``'s group (its resource pool's: roles on one pool take turns), or the controller's."""
        pool = {"critic": self.config.critic.pool, "rollout": self.config.rollout.pool}.get(role or "",
                                                                                        self.config.actor.pool)
        return lane_of(None if role is None else pool)

    # ------------------------------------------------------------------ prompts and responses
    def next_prompts(self, n: int | None = None) -> DataBatch:
        """The next ``n`` (default ``rollout_batch_prompts``) prompts, left-padded, with ground truths and group
        ids (``uid``)."""
        with self.timed(Stage.NEXT_PROMPTS) as summary:
            return summary.attach(self.prompts.next_batch(n or self.config.batch.rollout_batch_prompts))

    def rollout(self) -> Batch:
        """This step's responses: generated now from the next prompts, or, when generation runs ahead of training
        (``rollout.max_staleness`` > 0), those generated for this step earlier, while the steps before trained."""
        if self.config.rollout.max_staleness:
            return self.ahead.take(self.current_step)
        return self.generate(self.next_prompts())

    def generate(self, prompts: Batch, greedy: bool = False, n: int | None = None) -> Batch:
        """Responses from the actor (``samples_per_prompt`` per prompt unless ``n``), or from the rollout group when
        it has a pool of its own; each row's ``policy_version`` says which policy generated it."""
        return self._generate(prompts, self.current_step, greedy, n)

    def _draw_ahead(self, step: StepContext, ahead: bool) -> Batch:
        return self._generate(self.next_prompts(), step, ahead=ahead)

    def _generate(self, prompts: Batch, step: StepContext, greedy: bool = False, n: int | None = None,
                  ahead: bool = False) -> Batch:
        """``generate`` for ``step`` (``ahead``: a later step's, which leaving ``overlapped()`` does not wait for)."""
        seed, version = step.seed(Stage.GENERATE), self.state.policy_version
        group, role, synced = self.group("actor"), "actor", None
        if "rollout" in self.groups.by_role:
            synced = self.rollout_sync.sync(self.runner, self.current_step, group, self.groups.by_role["rollout"],
                                            version, (self._lane("actor"), self._lane("rollout")))
            group, role = self.groups.by_role["rollout"], "rollout"

        def responses(_: DataBatch) -> DataBatch:
            if synced is not None:  # the weight load these responses follow
                stats = synced.result()
                step.record({"rollout/sync_s": stats["seconds"], "rollout/sync_bytes": stats["copied_bytes"]})
            batch = group.generate_sequences(resolve(prompts), greedy=greedy, n=n, seed=seed)
            if "policy_version" not in batch:  # the actor's own ranks: generated by the current policy
                batch["policy_version"] = np.full(len(batch), version, dtype=np.int64)
            return batch

        writes = (*GENERATED_COLUMNS, *resolve(prompts).non_tensors)
        return self.runner.batch_stage(Stage.GENERATE, step, self._lane(role), None, responses, PROMPT_COLUMNS,
                                       writes, detached=ahead, after=synced)

    # ------------------------------------------------------------------ scores and log-probs
    def _batch_stage(self, stage: Stage, role: str | None, batch: Batch, body: Any, reads: tuple[str, ...] | None,
                     writes: tuple[str, ...], **options: Any) -> Batch:
        if stage in self.skipped:
            return batch
        return self.runner.batch_stage(stage, self.current_step, self._lane(role), batch, body, reads, writes,
                                       **options)

    def reward(self, batch: Batch) -> Batch:
        """Sequence ``scores`` (the task's rule or the reward model) and ``token_level_scores`` (the score on the last
        response token); ``costs`` when the task has a cost rule."""
        learned = "reward_model" in self.groups.by_role
        cost = self.task.cost

        def scores(rows: DataBatch) -> DataBatch:
            if learned:
                scores = self.groups.by_role["reward_model"].compute_rm_score(rows.select(*TRAINING_COLUMNS))["scores"]
            else:
                scores = self._rule_scores(rows, self.task.reward, "reward")
            columns = {"scores": scores, "token_level_scores": token_level(scores, rows["response_mask"])}
            if cost is not None:
                columns["costs"] = self._rule_scores(rows, cost, "cost")
            return DataBatch(columns)

        writes = ("scores", "token_level_scores", *(("costs",) if cost is not None else ()))
        return self._batch_stage(Stage.REWARD, "reward_model" if learned else None, batch, scores, None, writes)

    def _rule_scores(self, batch: DataBatch, fn: Any, name: str) -> torch.Tensor:
        """``fn``'s scores under the run's reward guard; rows it cannot score count in ``<name>/errors`` etc."""
        scored = rule_scores(batch, fn, self.reward_guard)
        for kind, count in scored.meta["reward_failures"].items():
            self.current_step.count(f"{name}/{kind}", count)
        return scored["scores"]

    def shape_rewards(self, batch: Batch) -> Batch:
        """``scores`` (and ``token_level_scores``) rewritten with the run's reward shaping of each response's length:
        DAPO's overlong penalty (``algorithm.overlong_buffer``, ``overlong_factor``); its mean is
        ``reward/length_penalty``."""
        def shaped(rows: DataBatch) -> DataBatch:
            columns, penalty = shaped_scores(rows, self.task.shaping)
            self.current_step.record({"reward/length_penalty": penalty})
            return columns

        return self._batch_stage(Stage.SHAPE_REWARDS, None, batch, shaped, ("scores", "response_mask"),
                                 ("scores", "token_level_scores"), replaces=True)

    def old_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropy`` of the responses under the current policy."""
        return self._batch_stage(Stage.OLD_LOG_PROB, "actor", batch, self.group("actor").compute_log_prob,
                                 TRAINING_COLUMNS, ("old_log_probs", "entropy"))

    def ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_probs`` under the frozen reference policy."""
        return self._batch_stage(Stage.REF, "actor", batch, self.group("actor").compute_ref_log_prob,
                                 TRAINING_COLUMNS, ("ref_log_probs",))

    def values(self, batch: Batch) -> Batch:
        """The critic's ``values`` per response token."""
        return self._batch_stage(Stage.VALUES, "critic", batch, self.critic.compute_values, TRAINING_COLUMNS,
                                 ("values",))

    # ------------------------------------------------------------------ rewards into advantages
    def kl_penalty(self, batch: Batch) -> Batch:
        """The KL to the reference in the rewards (PPO's way, ``algorithm.kl_reward_coef``): ``token_rewards`` are
        ``token_level_scores`` minus beta times each token's KL (``kl_reward_kind``), and with costs ``token_costs``
        are ``costs`` plus it. beta is the KL controller's value, which this updates (adaptive with
        ``algorithm.kl_target``) once per call."""
        kind, kl = self.config.algorithm.kl_reward_kind, self.state.kl

        def penalised(rows: DataBatch) -> DataBatch:
            beta = kl.value
            columns, mean_kl = kl_penalised_rewards(rows, beta, kind)
            self.current_step.record({"actor/reward_kl_penalty": mean_kl, "actor/reward_kl_penalty_coeff": beta})
            kl.update(mean_kl, len(rows))
            return columns

        writes = ("token_rewards", *(("token_costs",) if "costs" in batch else ()))
        return self._batch_stage(Stage.KL_PENALTY, None, batch, penalised,
                                 ("response_mask", "token_level_scores", "old_log_probs", "ref_log_probs"), writes,
                                 optional=("costs",))

    def advantages(self, batch: Batch, estimator: str | None = None, scores: str = "scores") -> Batch:
        """``advantages`` and ``returns`` with the algorithm's estimator (or ``estimator``), and the token rewards it
        saw: those ``kl_penalty`` made (``token_costs`` for ``scores="costs"``), else ``scores`` on each
        response's last token. Per-token estimators (GAE, REINFORCE++) read them per token, the others per
        sequence."""
        penalised = "token_costs" if scores == "costs" else "token_rewards"
        algorithm = self.config.algorithm
        if Stage.ADV in self.skipped:
            return batch
        if algorithm.kl_reward_coef > 0 and penalised not in batch:
            raise ValueError(f"algorithm.kl_reward_coef={algorithm.kl_reward_coef} puts the KL in the rewards, but "
                             f"this batch has no {penalised}: call lab.kl_penalty(batch) first (the dataflows do)")
        estimate = get_advantage_estimator(estimator or self.needs.algorithm.estimator)

        def advantages(rows: DataBatch) -> DataBatch:
            return advantage_columns(rows, estimate, algorithm, scores, penalised)

        return self._batch_stage(Stage.ADV, None, batch, advantages, ("response_mask", "uid", scores),
                                 ("advantages", "returns", penalised),
                                 optional=(penalised, "values", "baseline_scores"))

    # ------------------------------------------------------------------ updates
    def update_critic(self, batch: Batch) -> PendingMetrics:
        """One pass of critic updates over the step's sequences (needs ``values`` and ``returns``); its metrics,
        recorded in the step."""
        critic = self.critic
        step, seed = self.current_step, self.current_step.seed(Stage.UPDATE_CRITIC)

        def update(rows: DataBatch, summary: StageSummary) -> Metrics:
            metrics = summary.attach_metrics(critic.update_critic(rows, seed=seed).meta["metrics"])
            step.record(metrics)
            return metrics

        return PendingMetrics(self.runner.call_stage(Stage.UPDATE_CRITIC, step, self._lane("critic"), batch,
                                                   (*TRAINING_COLUMNS, "values", "returns"), update))

    def update_actor(self, batch: Batch) -> PendingMetrics:
        """Policy updates with ``algorithm.policy_loss`` (needs ``advantages``), plus ``algorithm.kl_loss_coef``
        times the KL to the reference when set (GRPO's way; needs ``ref_log_probs``); its metrics, recorded in the
        step, with the batch's ``rollout/staleness`` (policy versions behind this update). A rollout group of its
        own gets the new weights."""
        algorithm, actor = self.config.algorithm, self.group("actor")
        step, seed, version = self.current_step, self.current_step.seed(Stage.UPDATE_ACTOR), self.state.policy_version
        keys = [k for k in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "policy_version") if k in batch]

        def update(rows: DataBatch, summary: StageSummary) -> Metrics:
            if "policy_version" in rows:
                step.record(staleness(version - rows.pop("policy_version")["policy_version"]))
            result = actor.update_actor(rows, policy_loss=get_policy_loss(algorithm.policy_loss),
                                        kl_coef=algorithm.kl_loss_coef, seed=seed)
            metrics = summary.attach_metrics(result.meta["metrics"])
            step.record(metrics)
            return metrics

        metrics = self.runner.call_stage(Stage.UPDATE_ACTOR, step, self._lane("actor"), batch,
                                         (*TRAINING_COLUMNS, "advantages", *keys), update)
        self.state.policy_version += 1
        if "rollout" in self.groups.by_role:
            self.rollout_sync.sync(self.runner, step, actor, self.groups.by_role["rollout"],
                                   self.state.policy_version, (self._lane("actor"), self._lane("rollout")))
        return PendingMetrics(metrics)
