"""``Lab``: the single controller of an RL run, living in a notebook kernel or a script.

Building a Lab validates the config and starts the worker groups; every RLHF stage is a
public method that takes and returns a ``DataBatch``, so a notebook can run an iteration
cell by cell. ``step()`` runs the configured algorithm's dataflow (``dataflows.py``) and
``run(n)`` repeats it with metrics, checkpoints and a progress bar. Re-running the cell that
builds a Lab with the same name replaces its worker groups.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow_lab.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty
from hybridflow_lab.algorithms.registry import get_advantage_estimator, get_policy_loss
from hybridflow_lab.algorithms.safe_rlhf import LagrangeMultiplier
from hybridflow_lab.config import LabConfig, to_dict
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.config.validate import resolve_device
from hybridflow_lab.controller import ResourcePool, Role, WorkerCallError, WorkerGroup, init_cluster
from hybridflow_lab.dataflows import Metrics, RunNeeds, StepContext, check_config
from hybridflow_lab.dataflows.pending import Batch, resolve
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.redact import redact
from hybridflow_lab.tasks.base import Example
from hybridflow_lab.tasks.prompts import encode_prompts, rendered_prompts
from hybridflow_lab.telemetry import (
    DataflowGraph,
    JsonlSink,
    Phase,
    StageSummary,
    TelemetryStore,
    dataflow_graph,
    sample_rows,
)
from hybridflow_lab.trainer import checkpointing
from hybridflow_lab.trainer.capture import capture_step, captured_stages, read_capture
from hybridflow_lab.trainer.metrics import accuracy, data_metrics, throughput
from hybridflow_lab.trainer.relayout import Reconfigured, carried_states
from hybridflow_lab.trainer.replay import Replayed, ReplayError, policy_copy, replay_batch
from hybridflow_lab.trainer.rollouts_ahead import RolloutsAhead
from hybridflow_lab.trainer.run_log import MetricsLog
from hybridflow_lab.trainer.stage_runner import OPTIONAL, StageRunner, lane_of
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.trainer.task_setup import build_task
from hybridflow_lab.workers import ActorWorker, CriticWorker, RewardModelWorker, rule_scores
from hybridflow_lab.workers.reward import token_level
from hybridflow_lab.workers.reward_guard import RewardGuard
from hybridflow_lab.workers.rollout import RolloutWorker

if TYPE_CHECKING:
    from hybridflow_lab.placement import Placement

_running_labs: dict[str, weakref.ref[Lab]] = {}  # by name: what a re-run notebook cell replaces
TRAINING_COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
PROMPT_COLUMNS = ("input_ids", "attention_mask")  # what generation reads of the prompts (the graph's edge)
RAY_LOG = "ray.log"  # Ray's start-up lines, kept out of notebook cells
WEIGHTS = "policy weights"  # what gather_weights hands to sync_weights (the graph's edge)


def staleness(behind: np.ndarray) -> Metrics:
    """``rollout/staleness_{min,mean,max}``: how many policy versions each row's generator was behind."""
    return {"rollout/staleness_min": float(behind.min()), "rollout/staleness_mean": float(behind.mean()),
            "rollout/staleness_max": float(behind.max())}


def place(config: LabConfig, placement: Placement) -> LabConfig:
    """``config`` run with ``placement``, checked (``Placement.apply``) and its pools fitted to this machine's
    memory."""
    from hybridflow_lab.placement.hardware import machine_profile
    from hybridflow_lab.placement.workload import workload_from_config

    placed = placement.apply(config)
    placement.check_memory(workload_from_config(placed), machine_profile(placement.devices_needed()))
    return placed


class Lab:
    """An RL run: config, task, worker groups and the state between steps."""

    def __init__(self, config: LabConfig | str | os.PathLike[str] | None = None, *, overrides: tuple[str, ...] = (),
                 name: str | None = None, start: bool = True, resume: bool = False,
                 placement: Placement | None = None) -> None:
        self.config = resolve_config(config, overrides)
        if placement is not None:  # the placed config is what runs, and what gets checked
            self.config = place(self.config, placement)
        self.needs: RunNeeds = check_config(self.config)  # what this run builds and which stages run
        self._captured = captured_stages(self.config)
        self.name = name or Path(self.config.trainer.run_dir).name
        self.run_dir = Path(self.config.trainer.run_dir)
        self.tokenizer = load_tokenizer(self.config.actor.model_path)
        self.task = build_task(self.config)
        self._reset_run_state()
        self.telemetry = TelemetryStore()
        self._runner = StageRunner(self.name, self.telemetry, self._add_recovery_note)
        self.history: list[dict[str, float]] = []  # each step's metrics, with its "step"
        self.samples: list[dict[str, Any]] = []  # a few rows of each step's batch, with their "step"
        self.last_batch: DataBatch | None = None
        self.last_eval: DataBatch | None = None  # the last evaluation's greedy responses and scores
        self._step_listeners: list[Callable[[dict[str, float]], None]] = []
        self.groups: dict[str, WorkerGroup] = {}
        self._pools: list[ResourcePool] = []
        self.log: MetricsLog | None = None
        self._spans: JsonlSink | None = None
        if start:
            self.start(resume=resume)

    # ------------------------------------------------------------------ lifetime
    def start(self, resume: bool = False, carried: dict[str, TrainingState] | None = None) -> None:
        """Start (or restart) the worker groups; with ``resume``, continue from the latest checkpoint, with
        ``carried`` from those trained roles' states (``reconfigure``). A running Lab of the same name (the notebook
        cell that built it, run again) is shut down first."""
        previous = _running_labs.get(self.name)
        if previous is not None and previous() not in (None, self):
            previous().shutdown()
        _running_labs[self.name] = weakref.ref(self)
        self.shutdown()
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config.backend == "ray":
            init_cluster(log_file=self.run_dir / RAY_LOG)
        self._spans = JsonlSink(self.run_dir / "spans.jsonl").attach(self.telemetry)
        self.log = MetricsLog(self.run_dir, config.trainer.wandb_project if config.trainer.wandb else None,
                              to_dict(config))
        device = resolve_device(config)
        pools = self._build_pools(device)
        options = {"backend": config.backend, "telemetry": self.telemetry, "device": device}
        actor_pool = pools[config.actor.pool]
        carried = carried or {}
        self.groups["actor"] = WorkerGroup(Role(ActorWorker, config, self.needs.reference_model, carried.get("actor")),
                                           actor_pool, name=f"{self.name}.actor", meshes=ActorWorker.meshes(config),
                                           **options)
        if self.needs.critic:
            self.groups["critic"] = WorkerGroup(Role(CriticWorker, config, carried.get("critic")),
                                                pools[config.critic.pool],
                                                name=f"{self.name}.critic", **options)
        if self.needs.rollout_group:
            self.groups["rollout"] = WorkerGroup(Role(RolloutWorker, config), pools[config.rollout.pool],
                                                 name=f"{self.name}.rollout", **options)
        self._rollout_version, self._rollout_sync = None, None  # the policy version the rollout group holds
        self._policy_cache: tuple[int | None, torch.nn.Module | None] = (None, None)  # replays' copy of the policy
        self._ahead = RolloutsAhead(config.rollout.max_staleness)
        if self.needs.reward_model:
            self.groups["reward_model"] = WorkerGroup(
                Role(RewardModelWorker, config.reward_model_path, config.batch.micro_batch_sequences_per_rank),
                actor_pool, name=f"{self.name}.reward_model", **options)
        if resume and checkpointing.latest(self.run_dir) is not None:
            self.load()
        else:  # a fresh run in a used directory: earlier runs' metrics would mix into this one's
            self.log.truncate_after(self.step_index)

    def recover(self) -> int:
        """Rebuild the worker groups after a failure (a dead worker, an interrupted collective) and continue
        from the run's latest checkpoint, or from step 0 without one; returns the step it continues from."""
        if checkpointing.latest(self.run_dir) is None:
            self.task = build_task(self.config)
            self._reset_run_state()
            self._forget_steps_after(0)
        self.start(resume=True)
        return self.step_index

    def _reset_run_state(self) -> None:
        """The controller's state at step 0: the step counter, prompt ids, KL and Lagrange controllers."""
        algorithm = self.config.algorithm
        self.kl = AdaptiveKLController(algorithm.kl_reward_coef, algorithm.kl_target, algorithm.kl_horizon) \
            if algorithm.kl_target > 0 else FixedKLController(algorithm.kl_reward_coef)
        self.lagrange = LagrangeMultiplier(algorithm.lagrange_init, algorithm.lagrange_lr, algorithm.cost_limit)
        self.step_index, self._next_uid = 0, 0
        self.policy_version = 0  # actor updates so far: each batch's policy_version says which one generated it
        self._step: StepContext | None = None
        self._ahead = RolloutsAhead(self.config.rollout.max_staleness)

    def _forget_steps_after(self, step: int) -> None:
        """Drop the metrics and samples of steps after ``step`` (they are replayed from there)."""
        self.history = [m for m in self.history if m["step"] <= step]
        self.samples = [row for row in self.samples if row["step"] <= step]
        if self.log is not None:
            self.log.truncate_after(step)

    def _recovery_hint(self) -> str:
        checkpoint = checkpointing.latest(self.run_dir)
        where = f"checkpoint {checkpoint} (step {checkpointing.read_state(checkpoint)['step']})" if checkpoint \
            else f"step 0 (no checkpoint under {self.run_dir / 'checkpoints'} yet)"
        return f"lab.recover() rebuilds the worker groups and continues from {where}"

    @property
    def placement(self) -> Placement:
        """Where the models run and their parallel sizes (prints as a table; ``to_yaml()`` saves it)."""
        from hybridflow_lab.placement import Placement

        return Placement.from_config(self.config)

    @property
    def reward_guard(self) -> RewardGuard:
        """How rows the task's reward function cannot score are handled (``task.reward_on_error`` etc.)."""
        return RewardGuard.from_config(self.config.task)

    @property
    def trained_roles(self) -> tuple[str, ...]:
        """The configured roles with their own ``RoleConfig`` (and pool): the actor, and the critic if used."""
        return self.needs.trained_roles

    @property
    def current_step(self) -> StepContext:
        """The iteration the stages record into (metrics, seconds, seeds): step ``step_index``. Stages called cell
        by cell record into it too; ``step()`` starts it afresh. Inside a running stage: that stage's step."""
        running = self._runner.current_step()
        if running is not None:
            return running
        if self._step is None or self._step.index != self.step_index:
            self._step = StepContext(self.step_index, self.config.seed)
        return self._step

    def _build_pools(self, device: str) -> dict[str, ResourcePool]:
        """One resource pool per pool name in the config, sized by the ranks of the roles placed on it
        (a GPU per slot on ``cuda``)."""
        pools = {pool: ResourcePool(slots, use_gpu=device == "cuda", name=f"{self.name}.{pool}")
                 for pool, slots in self.config.pool_nodes(self.needs.pooled_roles).items()}
        self._pools = list(pools.values())
        return pools

    def reconfigure(self, *overrides: str) -> Reconfigured:
        """Apply dotted overrides (placement, parallel sizes, engines, batch sizes, task, ...) after validating them
        and the task under them. Running worker groups restart in the new layout and go on from where they were:
        each trained role's weights, optimizer state and schedule are gathered (``training_state``) and loaded into
        the new layout, whatever its engine, ranks or tensor parallelism; the step, prompt stream and KL and
        Lagrange controllers stay. The step is checkpointed first, so a layout that fails to start loses nothing.
        A role that cannot carry its state (another model or LoRA setting) starts from its model path, with a
        warning. The task (its prompt stream, its reward function) stays unless ``task.*`` changed."""
        start = time.perf_counter()
        config = resolve_config(self.config, overrides)
        needs = check_config(config)
        captured = captured_stages(config)
        checked = build_task(config)  # the task's checks (dataset rows, prompt lengths) under the new settings
        self._ahead.rewind(self)  # responses generated ahead are dropped, and their prompts drawn again
        if config.task != self.config.task:
            self.task = checked
        else:  # the same task goes on: its prompt stream, and a reward function the notebook may have replaced
            self.task.shaping = checked.shaping
        if config.actor.model_path != self.config.actor.model_path:
            self.tokenizer = load_tokenizer(config.actor.model_path)
        self._captured = captured
        if not self.groups:
            self.config, self.needs = config, needs
            return Reconfigured(tuple(overrides), config, self.step_index)
        states = {role: group.training_state()[0] for role, group in self._trained_groups().items()}
        checkpoint = self.save()
        carried, fresh = carried_states(self.config, config, needs.trained_roles, states)
        self.config, self.needs = config, needs
        try:
            self.start(carried=carried)
        except BaseException as error:
            error.add_note(f"step {self.step_index} is saved in {checkpoint}: Lab(<a config that starts>, "
                           "resume=True) continues from it")
            raise
        for role, why in fresh.items():
            if role in states:
                warnings.warn(f"lab.reconfigure: the {role}'s trained state was not carried over ({why}); it is in "
                              f"{checkpoint}", stacklevel=2)
        return Reconfigured(tuple(overrides), config, self.step_index, True,
                            {role: state.nbytes for role, state in carried.items()}, fresh, str(checkpoint),
                            time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop the worker groups and close the logs (the Lab can be started again)."""
        self._runner.close()  # stages still running (generation ahead, a weight load) finish first
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        for pool in self._pools:
            pool.release()
        self._pools = []
        for closable in (self.log, self._spans):
            if closable is not None:
                closable.close()
        self.log, self._spans = None, None

    @property
    def actor(self) -> WorkerGroup:
        if "actor" not in self.groups:
            raise RuntimeError("the Lab's worker groups are not running; call lab.start()")
        return self.groups["actor"]

    @property
    def critic(self) -> WorkerGroup:
        if "critic" not in self.groups:
            raise RuntimeError(f"algorithm {self.config.algorithm.name!r} runs without a critic")
        return self.groups["critic"]

    # -------------------------------------------------------------------- stages
    def _stage(self, stage: Stage) -> AbstractContextManager[StageSummary]:
        """Time a controller-side stage of the current step (``timing_s/<stage>``, a STAGE span)."""
        return self._runner.timed(stage, self.current_step)

    def _add_recovery_note(self, error: WorkerCallError, stage: str) -> None:
        error.add_note(f"in the Lab's {stage!r} stage, {self.step_index} steps completed; " + self._recovery_hint())

    def _lane(self, role: str | None) -> str:
        """Where a stage of ``role``'s group runs in an overlapped step: its resource pool's lane (roles on one
        pool take turns), or the controller's (None)."""
        pool = {"critic": self.config.critic.pool, "rollout": self.config.rollout.pool}.get(role or "",
                                                                                        self.config.actor.pool)
        return lane_of(None if role is None else pool)

    @contextmanager
    def overlapped(self, enabled: bool = True) -> Iterator[None]:
        """Inside, each stage returns at once (a ``PendingBatch``, or a ``Future`` of an update's metrics) and runs
        as soon as the columns it reads exist: stages on different resource pools, and the controller's own
        computations, run at the same time; a pool's stages run in the order they were called. Leaving waits
        for them all and raises the first failure. ``lab.step()`` runs its dataflow this way
        (``trainer.overlap``); with the local backend every rank lives in this process, so stages run in order."""
        with self._runner.overlapped(enabled and self.config.backend == "ray"):
            yield

    @property
    def stage_summaries(self) -> list[StageSummary]:
        """The summaries of the last step's stages (or of the last ``overlapped()`` block), each with the stages
        that ran alongside it."""
        return list(self._runner.summaries)

    @property
    def models(self) -> list[str]:
        """The models this run's stages run on, as the dataflow graph names its rows."""
        needs = self.needs
        return ["rollout", "actor", *(["reference"] if needs.reference else []), *(["critic"] if needs.critic else []),
                "reward model" if needs.reward_model else "reward function", "controller"]

    def graph(self, step: int | None = None) -> DataflowGraph:
        """The dataflow graph of ``step`` (default: the step running now, else the last one): the stages called on
        their models, live (running, done with seconds and bytes moved, not reached yet), and the columns
        between them with their sizes. Drawn from the stages' telemetry, so a notebook's own dataflow is drawn
        too; displays as an SVG (live, with a stage selector, as the first panel of ``hybridflow_lab.ui.dashboard``)."""
        return dataflow_graph(self.telemetry.spans(phase=Phase.STAGE), self.telemetry.running(), self.models, step,
                              self.step_index)

    def next_prompts(self, n: int | None = None) -> DataBatch:
        """The next ``rollout_batch_prompts`` prompts, left-padded, with ground truths and group ids (``uid``)."""
        with self._stage(Stage.NEXT_PROMPTS) as summary:
            examples = self.task.source.next_batch(n or self.config.batch.rollout_batch_prompts)
            batch = self._encode(examples)
            batch["data_source"] = [e.data_source for e in examples]
            batch["uid"] = np.arange(self._next_uid, self._next_uid + len(examples))
            self._next_uid += len(examples)
            return summary.attach(batch)

    def _encode(self, examples: list[Example]) -> DataBatch:
        texts, truths = [e.prompt for e in examples], [e.answer for e in examples]
        rollout = self.config.rollout
        return encode_prompts(self.tokenizer, texts, rollout.max_prompt_tokens, truths, rollout.pad_prompts,
                              self.task.prompt_format)

    def rollout(self) -> Batch:
        """This step's responses: generated now from the next prompts, or, when generation runs ahead of training
        (``rollout.max_staleness`` > 0), those generated for this step earlier, while the steps before trained."""
        if self.config.rollout.max_staleness:
            return self._ahead.take(self)
        return self.generate(self.next_prompts())

    def generate(self, prompts: Batch, greedy: bool = False, n: int | None = None) -> Batch:
        """Responses from the actor (``samples_per_prompt`` per prompt unless ``n``), or from the rollout group when
        it has a pool of its own; each row's ``policy_version`` says which policy generated it."""
        return self._generate(prompts, self.current_step, greedy, n)

    def _generate(self, prompts: Batch, step: StepContext, greedy: bool = False, n: int | None = None,
                  ahead: bool = False) -> Batch:
        """``generate`` for ``step`` (``ahead``: a later step's, which leaving ``overlapped()`` does not wait for)."""
        seed = step.seed(Stage.GENERATE)
        group, role, version, synced = self.actor, "actor", self.policy_version, None
        if "rollout" in self.groups:
            synced = self._sync_rollout()
            group, role = self.groups["rollout"], "rollout"

        def responses(_: DataBatch) -> DataBatch:
            if synced is not None:  # the weight load these responses follow
                stats = synced.result() if isinstance(synced, Future) else synced
                step.record({"rollout/sync_s": stats["seconds"], "rollout/sync_bytes": stats["copied_bytes"]})
            batch = group.generate_sequences(resolve(prompts), greedy=greedy, n=n, seed=seed)
            if "policy_version" not in batch:  # the actor's own ranks: generated by the current policy
                batch["policy_version"] = np.full(len(batch), version, dtype=np.int64)
            return batch

        after = synced if isinstance(synced, Future) else None
        return self._runner.batch_stage(Stage.GENERATE, step, self._lane(role), None, responses, PROMPT_COLUMNS,
                                        detached=ahead, after=after)

    def _sync_rollout(self) -> Future[dict[str, Any]] | dict[str, Any] | None:
        """Load the actor's weights into the rollout group if it holds an older policy version: gathered on the
        actor's lane (after the updates called before), loaded on the rollout group's (after the generations
        called before), timed and fingerprinted (``sync_weights``; ``rollout/sync_s`` in the steps whose responses
        follow it). Returns the last load's numbers (a ``Future`` of them when overlapped)."""
        if self._rollout_version == self.policy_version:
            return self._rollout_sync
        step, version = self.current_step, self.policy_version

        def gather(rows: DataBatch, summary: StageSummary) -> dict[str, torch.Tensor]:
            gathered = self.actor.policy_weights()[0]
            summary.columns = {WEIGHTS: {"shape": [len(gathered)], "dtype": "state_dict",
                                         "bytes": sum(t.element_size() * t.numel() for t in gathered.values())}}
            return gathered

        weights = self._runner.call_stage(Stage.GATHER_WEIGHTS, step, self._lane("actor"), None, (), gather)

        def load(rows: DataBatch, summary: StageSummary) -> dict[str, Any]:
            sent = weights.result() if isinstance(weights, Future) else weights
            return self.groups["rollout"].load_policy(sent, version)[0]

        self._rollout_sync = self._runner.call_stage(Stage.SYNC_WEIGHTS, step, self._lane("rollout"), None,
                                                     (WEIGHTS,), load, detached=True,
                                                     after=weights if isinstance(weights, Future) else None)
        self._rollout_version = version
        return self._rollout_sync

    def reward(self, batch: Batch) -> Batch:
        """Sequence ``scores`` (the task's rule or the reward model) and ``token_level_scores`` (the score on the last
        response token); ``costs`` when the task has a cost rule."""
        learned = "reward_model" in self.groups

        def scores(rows: DataBatch) -> DataBatch:
            if learned:
                scores = self.groups["reward_model"].compute_rm_score(rows.select(*TRAINING_COLUMNS))["scores"]
            else:
                scores = self._rule_scores(rows, self.task.reward, "reward")
            columns = {"scores": scores, "token_level_scores": token_level(scores, rows["response_mask"])}
            if self.task.cost is not None:
                columns["costs"] = self._rule_scores(rows, self.task.cost, "cost")
            return DataBatch(columns)

        writes = ("scores", "token_level_scores", *(("costs",) if self.task.cost is not None else ()))
        lane = self._lane("reward_model" if learned else None)
        return self._runner.batch_stage(Stage.REWARD, self.current_step, lane, batch, scores, writes=writes)

    def shape_rewards(self, batch: Batch) -> Batch:
        """``scores`` (and ``token_level_scores``) rewritten with the run's reward shaping of each response's length:
        DAPO's overlong penalty (``algorithm.overlong_buffer``, ``overlong_factor``); its mean is
        ``reward/length_penalty``."""
        def shaped(rows: DataBatch) -> DataBatch:
            penalty = self.task.shaping(rows["response_mask"].sum(-1))
            scores = rows["scores"] + penalty
            self.current_step.record({"reward/length_penalty": penalty.float().mean().item()})
            return DataBatch({"scores": scores, "token_level_scores": token_level(scores, rows["response_mask"])})

        return self._runner.batch_stage(Stage.SHAPE_REWARDS, self.current_step, self._lane(None), batch, shaped,
                                        reads=("scores", "response_mask"), writes=("scores", "token_level_scores"),
                                        replaces=True)

    def _rule_scores(self, batch: DataBatch, fn: Callable[..., float], name: str) -> torch.Tensor:
        """``fn``'s scores under the run's reward guard; rows it cannot score count in ``<name>/errors`` etc."""
        scored = rule_scores(batch, fn, self.reward_guard)
        for kind, count in scored.meta["reward_failures"].items():
            self.current_step.count(f"{name}/{kind}", count)
        return scored["scores"]

    def old_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropy`` of the responses under the current policy."""
        return self._runner.batch_stage(Stage.OLD_LOG_PROB, self.current_step, self._lane("actor"), batch,
                                        self.actor.compute_log_prob, reads=TRAINING_COLUMNS,
                                        writes=("old_log_probs", "entropy"))

    def ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_probs`` under the frozen reference policy."""
        return self._runner.batch_stage(Stage.REF, self.current_step, self._lane("actor"), batch,
                                        self.actor.compute_ref_log_prob, reads=TRAINING_COLUMNS,
                                        writes=("ref_log_probs",))

    def values(self, batch: Batch) -> Batch:
        """The critic's ``values`` per response token."""
        return self._runner.batch_stage(Stage.VALUES, self.current_step, self._lane("critic"), batch,
                                        self.critic.compute_values, reads=TRAINING_COLUMNS, writes=("values",))

    def kl_penalty(self, batch: Batch) -> Batch:
        """The KL to the reference in the rewards (PPO's way, ``algorithm.kl_reward_coef``): ``token_rewards`` are
        ``token_level_scores`` minus beta times each token's KL (``kl_reward_kind``), and with costs ``token_costs``
        are ``costs`` plus it, Safe-RLHF's mirror image. beta is the KL controller's value, which this updates
        (adaptive with ``algorithm.kl_target``) once per call."""
        kind = self.config.algorithm.kl_reward_kind

        def penalised(rows: DataBatch) -> DataBatch:
            mask, beta = rows["response_mask"], self.kl.value
            old, ref = rows["old_log_probs"], rows["ref_log_probs"]
            rewards, kl = apply_kl_penalty(rows["token_level_scores"], old, ref, mask, beta, kind)
            columns = {"token_rewards": rewards}
            if "costs" in rows:
                columns["token_costs"], _ = apply_kl_penalty(token_level(rows["costs"], mask), old, ref, mask, -beta,
                                                             kind)
            self.current_step.record({"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": beta})
            self.kl.update(kl, len(rows))
            return DataBatch(columns)

        reads = ("response_mask", "token_level_scores", "old_log_probs", "ref_log_probs", "costs" + OPTIONAL)
        writes = ("token_rewards", *(("token_costs",) if "costs" in batch else ()))
        return self._runner.batch_stage(Stage.KL_PENALTY, self.current_step, self._lane(None), batch, penalised,
                                        reads, writes)

    def advantages(self, batch: Batch, estimator: str | None = None, scores: str = "scores") -> Batch:
        """``advantages`` and ``returns`` with the algorithm's estimator (or ``estimator``), and the ``token_rewards``
        it saw (``token_costs`` for ``scores="costs"``): those ``kl_penalty`` made, else ``scores`` on each
        response's last token. Per-token estimators (GAE, REINFORCE++) read them per token, the others per
        sequence (GRPO, RLOO, ReMax, ...: ``score - beta * sum KL`` after the penalty)."""
        penalised = "token_costs" if scores == "costs" else "token_rewards"
        algorithm = self.config.algorithm
        if algorithm.kl_reward_coef > 0 and penalised not in batch:
            raise ValueError(f"algorithm.kl_reward_coef={algorithm.kl_reward_coef} puts the KL in the rewards, but "
                             f"this batch has no {penalised}: call lab.kl_penalty(batch) first (the dataflows do)")
        estimate = get_advantage_estimator(estimator or self.needs.algorithm.estimator)

        def advantages(rows: DataBatch) -> DataBatch:
            mask = rows["response_mask"]
            token_rewards = rows[penalised] if penalised in rows else token_level(rows[scores], mask)
            advantages, returns = estimate(
                token_rewards=token_rewards, scores=token_rewards.sum(-1), values=rows.get("values"),
                group_ids=torch.as_tensor(rows["uid"].astype(np.int64)), mask=mask,
                baseline_scores=rows.get("baseline_scores"), gamma=algorithm.gamma, lam=algorithm.lam,
            )
            return DataBatch({"advantages": advantages, "returns": returns, penalised: token_rewards})

        reads = ("response_mask", "uid", scores, *(key + OPTIONAL for key in (penalised, "values", "baseline_scores")))
        return self._runner.batch_stage(Stage.ADV, self.current_step, self._lane(None), batch, advantages, reads,
                                        writes=("advantages", "returns", penalised))

    def update_critic(self, batch: Batch) -> Metrics | Future[Metrics]:
        """One pass of critic updates over the step's sequences (needs ``values`` and ``returns``); returns the
        critic metrics (recorded in the step; a ``Future`` of them inside ``overlapped()``)."""
        step, seed = self.current_step, self.current_step.seed(Stage.UPDATE_CRITIC)

        def update(rows: DataBatch, summary: StageSummary) -> Metrics:
            metrics = summary.attach_metrics(self.critic.update_critic(rows, seed=seed).meta["metrics"])
            step.record(metrics)
            return metrics

        return self._runner.call_stage(Stage.UPDATE_CRITIC, step, self._lane("critic"), batch,
                                       (*TRAINING_COLUMNS, "values", "returns"), update)

    def update_actor(self, batch: Batch) -> Metrics | Future[Metrics]:
        """Policy updates with ``algorithm.policy_loss`` (needs ``advantages``), plus ``algorithm.kl_loss_coef``
        times the KL to the reference when set (GRPO's way; needs ``ref_log_probs``); returns the actor metrics
        (recorded in the step; a ``Future`` of them inside ``overlapped()``), with the batch's ``rollout/staleness``
        (policy versions behind this update: min, mean, max). A rollout group of its own gets the new weights."""
        algorithm = self.config.algorithm
        step, seed, version = self.current_step, self.current_step.seed(Stage.UPDATE_ACTOR), self.policy_version
        keys = [k for k in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "policy_version") if k in batch]

        def update(rows: DataBatch, summary: StageSummary) -> Metrics:
            if "policy_version" in rows:
                step.record(staleness(version - rows.pop("policy_version")["policy_version"]))
            result = self.actor.update_actor(rows, policy_loss=get_policy_loss(algorithm.policy_loss),
                                             kl_coef=algorithm.kl_loss_coef, seed=seed)
            metrics = summary.attach_metrics(result.meta["metrics"])
            step.record(metrics)
            return metrics

        metrics = self._runner.call_stage(Stage.UPDATE_ACTOR, step, self._lane("actor"), batch,
                                          (*TRAINING_COLUMNS, "advantages", *keys), update)
        self.policy_version += 1
        if "rollout" in self.groups:
            self._sync_rollout()
        return metrics

    # ---------------------------------------------------------------- iterations
    def step(self) -> Metrics:
        """One iteration of the algorithm's dataflow (``needs.algorithm.dataflow``); returns (and logs) its metrics."""
        self._step = step = self._ahead.context(self.step_index) or StepContext(self.step_index, self.config.seed)
        start = time.perf_counter()
        with self.overlapped(self.config.trainer.overlap):
            pending, metrics = self.needs.algorithm.dataflow(self, step)
        batch = resolve(pending)
        seconds = time.perf_counter() - start
        metrics = {**metrics, **data_metrics(batch, self.config.rollout.max_new_tokens),
                   **throughput(batch, seconds), "timing_s/step": seconds,
                   "train/accuracy": accuracy(batch["scores"])}
        trainer = self.config.trainer
        if self._captured:
            capture_step(self.run_dir, self.step_index + 1, batch, self.graph(self.step_index), self._captured,
                         trainer.capture_steps)
        self.step_index += 1
        self.last_batch = batch
        if trainer.eval_every and self.step_index % trainer.eval_every == 0:
            metrics.update(self.evaluate())
        self.history.append({"step": self.step_index, **metrics})
        samples = [{"step": self.step_index, **row} for row in sample_rows(batch, trainer.logged_samples)]
        self.samples.extend(samples)
        if self.log is not None:
            self.log.log(self.step_index, metrics)
            self.log.log_samples(self.step_index, samples)
        if trainer.save_every and self.step_index % trainer.save_every == 0:
            self.save()
        for listener in list(self._step_listeners):
            listener(metrics)
        return metrics

    def subscribe_steps(self, listener: Callable[[dict[str, float]], None]) -> Callable[[], None]:
        """Call ``listener(metrics)`` after every step (history and samples updated); returns an unsubscribe."""
        self._step_listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._step_listeners:
                self._step_listeners.remove(listener)

        return unsubscribe

    def run(self, steps: int | None = None) -> list[dict[str, float]]:
        """``steps`` iterations (default ``trainer.steps``) with a progress bar; returns their metrics."""
        from tqdm.auto import tqdm

        count = self.config.trainer.steps if steps is None else steps
        results = []
        with tqdm(total=count, disable=not self.config.trainer.progress, desc=self.name, unit="step",
                  mininterval=2.0) as bar:
            for _ in range(count):
                metrics = self.step()
                results.append(metrics)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}", acc=f"{metrics['train/accuracy']:.2f}")
                bar.update()
        return results

    def evaluate(self, examples: list[Example] | None = None) -> dict[str, float]:
        """Greedy accuracy, mean score and mean response length (tokens) on the held-out examples; the responses
        and their scores stay in ``last_eval``."""
        examples = examples if examples is not None else self.task.eval_examples
        with self._stage(Stage.EVALUATE):
            out = self.actor.generate_sequences(self._encode(examples), greedy=True, n=1, seed=0)
            scores = rule_scores(out, self.task.reward, self.reward_guard)["scores"]
        self.last_eval = out.union(DataBatch({"scores": scores}))
        return {"eval/accuracy": accuracy(scores), "eval/score": float(scores.mean()),
                "eval/response_length": float(out["response_mask"].sum(-1).float().mean())}

    def show(self, batch: DataBatch | None = None, rows: int = 8, special_tokens: bool = False) -> Any:
        """Prompts, responses, scores and mean advantages as a table (default: the last step's batch).

        ``prompt`` is the text the model read: the prompt as rendered by the chat template, its special
        tokens (``<|im_start|>``...) written out with ``special_tokens``.
        """
        import pandas as pd

        if batch is None:
            if self.last_batch is None:
                raise RuntimeError("no step has run yet; pass a batch (e.g. lab.show(lab.generate(...)))")
            batch = self.last_batch
        table = sample_rows(batch, rows)
        for row, prompt in zip(table, rendered_prompts(self.tokenizer, batch[: len(table)], special_tokens),
                               strict=True):
            row["prompt"] = prompt
        return pd.DataFrame(table)

    # ------------------------------------------------------------------- replays
    def replay(self, step: int, stage: str, *overrides: str, name: str | None = None) -> Replayed:
        """The batch captured after ``stage`` at ``step`` (``trainer.capture``; steps numbered as in ``history``)
        through the dataflow of this run's config with ``overrides`` (``"algorithm.name=rloo"``,
        ``"algorithm.policy_loss=gspo"``...): the stages after ``stage`` run again, and the actor's update is probed
        on a copy of the current policy (loss, clip fraction, gradient norm and the loss per token), so nothing
        of the run changes. ``hybridflow_lab.ui.compare(...)`` sets replays side by side."""
        batch, record = read_capture(self.run_dir, step, stage)
        config = resolve_config(self.config, overrides)
        needs = check_config(config)
        if needs.reference_model and not self.needs.reference_model:
            raise ReplayError("this replay needs the reference policy's log-probs (a KL term) and this Lab's actor "
                              "holds no reference policy; build the Lab with a KL term (algorithm.kl_loss_coef > 0)")
        policy = self._policy_copy()
        with self._replaying(config, needs):
            return replay_batch(self, batch, record, config, policy, name or " ".join(overrides) or
                                config.algorithm.name, tuple(overrides))

    def _policy_copy(self) -> torch.nn.Module:
        """The current policy on the controller (float32, CPU), gathered once per policy version."""
        version, model = self._policy_cache
        if version != self.policy_version or model is None:
            model = policy_copy(self.config.actor.model_path, self.actor.policy_weights()[0])
            self._policy_cache = (self.policy_version, model)
        return model

    @contextmanager
    def _replaying(self, config: LabConfig, needs: RunNeeds) -> Iterator[None]:
        """Inside, the stage methods run ``config``'s algorithm into a step of their own, with copies of the KL and
        Lagrange controllers and telemetry kept apart from the run's; everything is restored after."""
        if self._runner.overlapping:
            raise RuntimeError("a replay runs stage by stage; call it outside lab.overlapped() and lab.step()")
        saved = (self.config, self.needs, self._step, self.kl, self.lagrange, self._runner)
        self.config, self.needs, self.kl, self.lagrange = config, needs, copy.deepcopy(self.kl), \
            copy.deepcopy(self.lagrange)
        self._step = StepContext(self.step_index, config.seed)
        self._runner = StageRunner(f"{self.name} replay", TelemetryStore(), self._add_recovery_note)
        try:
            yield
        finally:
            self._runner.close()
            self.config, self.needs, self._step, self.kl, self.lagrange, self._runner = saved

    # --------------------------------------------------------------- checkpoints
    def _trained_groups(self) -> dict[str, WorkerGroup]:
        """The groups whose weights train and are checkpointed (not the frozen reward model, nor a rollout group,
        which copies the actor's)."""
        return {role: group for role, group in self.groups.items() if role in self.trained_roles}

    def save(self) -> Path:
        """Checkpoint every role and the controller state for ``step_index`` (atomically)."""
        with self._stage(Stage.SAVE):
            staging = checkpointing.staging_dir(self.run_dir, self.step_index)
            try:
                for role, group in self._trained_groups().items():
                    group.save_checkpoint(str(staging / role))
                source, next_uid = self._ahead.position(self.step_index) or (self.task.source.state_dict(),
                                                                             self._next_uid)
                state = {"step": self.step_index, "next_uid": next_uid, "policy_version": self.policy_version,
                         "source": source, "kl": self.kl.state_dict(),
                         "lagrange": self.lagrange.state_dict(), "config": redact(to_dict(self.config))}
                return checkpointing.commit(self.run_dir, self.step_index, state,
                                            self.config.trainer.keep_checkpoints)
            except BaseException as error:
                checkpointing.discard_staging(self.run_dir, self.step_index)
                previous = checkpointing.latest(self.run_dir)
                error.add_note(f"the checkpoint of step {self.step_index} was not written; "
                               + (f"{previous} is intact" if previous else "there is no earlier checkpoint"))
                raise

    def load(self, checkpoint: str | os.PathLike[str] | None = None) -> int:
        """Restore roles and controller state from ``checkpoint`` (default: the run's latest); returns its step."""
        path = Path(checkpoint) if checkpoint is not None else checkpointing.latest(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint under {self.run_dir / 'checkpoints'}")
        checkpointing.verify(path)
        state = checkpointing.read_state(path)
        for role, group in self._trained_groups().items():
            group.load_checkpoint(str(path / role))
        self.step_index, self._next_uid = state["step"], state["next_uid"]
        self.policy_version = state.get("policy_version", self.step_index)
        self._rollout_version = None  # the rollout group gets the loaded weights before it generates again
        self._policy_cache = (None, None)
        self._ahead.reset()
        self.task.source.load_state_dict(state["source"])
        self.kl.load_state_dict(state["kl"])
        self.lagrange.load_state_dict(state["lagrange"])
        self._forget_steps_after(self.step_index)
        return self.step_index

    def __repr__(self) -> str:
        groups = ", ".join(f"{role}: {group.world_size} ranks" for role, group in self.groups.items()) or "stopped"
        return f"Lab({self.name!r}, {self.config.algorithm.name}, step {self.step_index}; {groups})"

