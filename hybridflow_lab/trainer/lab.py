"""``Lab``: the single controller of an RL run, living in a notebook kernel or a script.

Building a Lab validates the config and starts the worker groups; every RLHF stage is a public method that
takes and returns a batch, so a notebook can run an iteration cell by cell. ``step()`` runs the configured
algorithm's dataflow (``dataflows/builtin.py``) and ``run(n)`` repeats it with metrics, checkpoints and a
progress bar. Re-running the cell that builds a Lab with the same name replaces its worker groups.

The Lab is a façade over its parts: ``RunGroups`` (the worker groups), ``RunStages`` (the stages),
``RunLoop`` (steps, history, logs), ``RunState`` (what a checkpoint keeps besides the models) and replays.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hybridflow_lab.config import LabConfig
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.controller import WorkerCallError, WorkerGroup
from hybridflow_lab.dataflows import Metrics, RunNeeds, check_config
from hybridflow_lab.dataflows.preflight import model_summary, resolve_device
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.base import Example
from hybridflow_lab.telemetry import DataflowGraph, Phase, StageSummary, TelemetryStore, dataflow_graph
from hybridflow_lab.trainer import checkpointing
from hybridflow_lab.trainer.batch_table import batch_table
from hybridflow_lab.trainer.capture import captured_stages, read_capture
from hybridflow_lab.trainer.groups import RunGroups
from hybridflow_lab.trainer.prompt_stream import PromptStream
from hybridflow_lab.trainer.relayout import Reconfigured, checked_relayout, place, restart_carrying
from hybridflow_lab.trainer.replay import Replayed, Replays
from hybridflow_lab.trainer.run_checkpoint import load_run, recovery_hint, save_run
from hybridflow_lab.trainer.run_loop import RunLoop
from hybridflow_lab.trainer.run_stages import RunStages
from hybridflow_lab.trainer.run_state import RunState
from hybridflow_lab.trainer.stage_runner import StageRunner
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.trainer.task_setup import TaskSetup, build_task

if TYPE_CHECKING:
    from hybridflow_lab.placement import Placement

_running_labs: dict[str, weakref.ref[Lab]] = {}  # by name: what a re-run notebook cell replaces
RAY_LOG = "ray.log"  # Ray's start-up lines, kept out of notebook cells
T = TypeVar("T")


def _stage(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` of ``RunStages`` as a method of the Lab, with its signature and docstring."""

    @functools.wraps(method)
    def stage(self: Lab, *args: Any, **kwargs: Any) -> T:
        return getattr(self._stages, method.__name__)(*args, **kwargs)

    return stage


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
        self.telemetry = TelemetryStore()
        self._groups = RunGroups(self.name)
        self._loop = RunLoop(self.run_dir)
        self._replays = Replays()
        self._fresh_run(build_task(self.config))
        if start:
            self.start(resume=resume)

    def _fresh_run(self, task: TaskSetup) -> None:
        """Step 0 of ``task``: a new prompt stream, state and stages."""
        self._prompts = PromptStream(task, self.tokenizer, self.config.rollout)
        self._state = RunState.fresh(self.config)
        self._rebuild_stages()

    def _rebuild_stages(self) -> None:
        self._runner = StageRunner(self.name, self.telemetry, self._add_recovery_note,
                                   self.config.trainer.stage_timeout_s)
        self._stages = RunStages(self.config, self.needs, self._groups, self._prompts, self._state, self._runner)

    # ------------------------------------------------------------------ the run's state
    task = property(lambda self: self._prompts.task, doc="The task: prompt stream, reward rule, held-out set.")
    step_index = property(lambda self: self._state.step_index, doc="Steps completed.")
    policy_version = property(lambda self: self._state.policy_version, doc="Actor updates so far.")
    kl = property(lambda self: self._state.kl, doc="The KL controller (its ``value`` is beta).")
    lagrange = property(lambda self: self._state.lagrange, doc="Safe-RLHF's Lagrange multiplier.")
    history = property(lambda self: self._loop.history, doc="Each step's metrics, with its ``step``.")
    samples = property(lambda self: self._loop.samples, doc="A few rows of each step's batch, with their ``step``.")
    last_batch = property(lambda self: self._loop.last_batch, doc="The last step's final batch.")
    last_eval = property(lambda self: self._loop.last_eval, doc="The last evaluation's responses and scores.")
    log = property(lambda self: self._loop.log, doc="The run directory's metrics log (and wandb's run).")
    groups = property(lambda self: self._groups.by_role, doc="The running worker groups by role.")
    trained_roles = property(lambda self: self.needs.trained_roles, doc="The roles with weights that train.")
    models = property(lambda self: self.needs.models, doc="The models the stages run on (the graph's rows).")
    reward_guard = property(lambda self: self._stages.reward_guard,
                            doc="How rows the task's reward function cannot score are handled.")
    current_step = property(lambda self: self._stages.current_step,
                            doc="The step the stages record into (metrics, seconds, seeds).")
    rollouts_ahead = property(lambda self: self._stages.ahead,
                              doc="The responses generated ahead of training (``rollout.max_staleness``).")

    @property
    def actor(self) -> WorkerGroup:
        return self._stages.group("actor")

    @property
    def critic(self) -> WorkerGroup:
        return self._stages.critic

    @property
    def placement(self) -> Placement:
        """Where the models run and their parallel sizes (prints as a table; ``to_yaml()`` saves it)."""
        from hybridflow_lab.placement import Placement

        return Placement.from_config(self.config)

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
        self._loop.open_logs(self.config, self.telemetry)
        self._rebuild_stages()
        self._groups.start(self.config, self.needs, resolve_device(self.config), self.telemetry, carried or {},
                           self.run_dir / RAY_LOG)
        if resume and checkpointing.latest(self.run_dir) is not None:
            self.load()
        else:  # a fresh run in a used directory: earlier runs' metrics would mix into this one's
            self._loop.forget_steps_after(self.step_index)

    def recover(self) -> int:
        """Rebuild the worker groups after a failure (a dead worker, an interrupted collective) and continue
        from the run's latest checkpoint, or from step 0 without one; returns the step it continues from."""
        if checkpointing.latest(self.run_dir) is None:
            self._fresh_run(build_task(self.config))
            self._loop.forget_steps_after(0)
        self.start(resume=True)
        return self.step_index

    def reconfigure(self, *overrides: str) -> Reconfigured:
        """Apply dotted overrides (placement, parallel sizes, engines, batch sizes, task, ...) after validating them
        and the task under them. Running worker groups restart in the new layout and go on from where they were:
        each trained role's weights, optimizer state and schedule are carried into the new layout, whatever its
        engine, ranks or tensor parallelism; the step, prompt stream and KL and Lagrange controllers stay. The step
        is checkpointed first, so a layout that fails to start loses nothing. A role that cannot carry its state
        (another model or LoRA setting) starts from its model path, with a warning. The task (its prompt stream,
        its reward function) stays unless ``task.*`` changed."""
        began = time.perf_counter()
        config, needs, captured, checked = checked_relayout(self.config, overrides)
        self._stages.ahead.rewind(self.step_index)  # responses generated ahead are dropped, their prompts drawn again
        task = checked if config.task != self.config.task else self.task
        task.shaping = checked.shaping  # the same task goes on, with a reward function the notebook may have set
        if config.actor.model_path != self.config.actor.model_path:
            self.tokenizer = load_tokenizer(config.actor.model_path)
        self._prompts = PromptStream(task, self.tokenizer, config.rollout, self._prompts.next_uid)
        self._captured = captured
        if not self.groups:
            self.config, self.needs = config, needs
            self._rebuild_stages()
            return Reconfigured(tuple(overrides), config, self.step_index)
        return restart_carrying(self._groups, self.config, config, needs.trained_roles, self.save,
                                lambda carried: self._start_as(config, needs, carried), self.step_index,
                                tuple(overrides), began)

    def _start_as(self, config: LabConfig, needs: RunNeeds, carried: dict[str, TrainingState]) -> None:
        self.config, self.needs = config, needs
        self.start(carried=carried)

    def shutdown(self) -> None:
        """Stop the worker groups and close the logs (the Lab can be started again)."""
        self._runner.close()  # stages still running (generation ahead, a weight load) finish first
        self._stages.close()
        self._groups.shutdown()
        self._loop.close_logs()

    def _add_recovery_note(self, error: WorkerCallError, stage: str) -> None:
        error.add_note(f"in the Lab's {stage!r} stage, {self.step_index} steps completed; "
                       + recovery_hint(self.run_dir))

    # ------------------------------------------------------------------ stages (RunStages has their docs)
    next_prompts = _stage(RunStages.next_prompts)
    rollout = _stage(RunStages.rollout)
    generate = _stage(RunStages.generate)
    reward = _stage(RunStages.reward)
    shape_rewards = _stage(RunStages.shape_rewards)
    old_log_prob = _stage(RunStages.old_log_prob)
    ref_log_prob = _stage(RunStages.ref_log_prob)
    values = _stage(RunStages.values)
    kl_penalty = _stage(RunStages.kl_penalty)
    advantages = _stage(RunStages.advantages)
    update_critic = _stage(RunStages.update_critic)
    update_actor = _stage(RunStages.update_actor)

    @contextmanager
    def overlapped(self, enabled: bool = True) -> Iterator[None]:
        """Inside, each stage returns at once and runs as soon as the columns it reads exist: stages on different
        resource pools, and the controller's computations, run at the same time, a pool's in call order. Leaving
        waits for them all and raises the first failure. ``lab.step()`` runs this way (``trainer.overlap``) on Ray.
        """
        with self._runner.overlapped(enabled and self.config.backend == "ray"):
            yield

    # ------------------------------------------------------------------ steps
    def step(self) -> Metrics:
        """One iteration of the algorithm's dataflow (``needs.algorithm.dataflow``); returns (and logs) its metrics."""
        return self._loop.step(self._stages, self.overlapped, self.graph, self._captured, self.save)

    def run(self, steps: int | None = None) -> list[dict[str, float]]:
        """``steps`` iterations (default ``trainer.steps``) with a progress bar; returns their metrics."""
        return self._loop.run(self.config.trainer.steps if steps is None else steps, self.step, self.config,
                              self.name)

    def evaluate(self, examples: list[Example] | None = None) -> dict[str, float]:
        """Greedy accuracy, mean score and mean response length (tokens) on the held-out examples; the responses
        and their scores stay in ``last_eval``."""
        return self._loop.evaluate(self._stages, examples)

    def subscribe_steps(self, listener: Callable[[dict[str, float]], None]) -> Callable[[], None]:
        """Call ``listener(metrics)`` after every step (history and samples updated); returns an unsubscribe."""
        return self._loop.subscribe(listener)

    # ------------------------------------------------------------------ looking at a run
    @property
    def stage_summaries(self) -> list[StageSummary]:
        """The summaries of the last step's stages (or of the last ``overlapped()`` block), each with the stages
        that ran alongside it."""
        return list(self._runner.summaries)

    def graph(self, step: int | None = None) -> DataflowGraph:
        """The dataflow graph of ``step`` (default: the step running now, else the last one), drawn from the stages'
        telemetry: the stages on their models, live, and the columns between them with their sizes."""
        return dataflow_graph(self.telemetry.spans(phase=Phase.STAGE), self.telemetry.running(), self.needs.models,
                              step, self.step_index)

    def show(self, batch: DataBatch | None = None, rows: int = 8, special_tokens: bool = False) -> Any:
        """Prompts (as the chat template rendered them; ``special_tokens`` written out), responses, scores and
        mean advantages as a table (default: the last step's batch)."""
        if batch is None and self.last_batch is None:
            raise RuntimeError("no step has run yet; pass a batch (e.g. lab.show(lab.generate(...)))")
        return batch_table(self.tokenizer, batch if batch is not None else self.last_batch, rows, special_tokens)

    def replay(self, step: int, stage: str, *overrides: str, name: str | None = None) -> Replayed:
        """The batch captured after ``stage`` at ``step`` (``trainer.capture``) through the dataflow of this run's
        config with ``overrides`` (``"algorithm.name=rloo"``...): the later stages run again and the actor's update
        is probed on a copy of the current policy, so nothing of the run changes."""
        if self._runner.overlapping:
            raise RuntimeError("a replay runs stage by stage; call it outside lab.overlapped() and lab.step()")
        config = resolve_config(self.config, overrides)
        runner = StageRunner(f"{self.name} replay", TelemetryStore(), self._add_recovery_note,
                             config.trainer.stage_timeout_s)
        return self._replays.run(self._stages, read_capture(self.run_dir, step, stage), config, check_config(config),
                                 runner, name or " ".join(overrides) or config.algorithm.name, overrides)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint every role and the controller state for ``step_index`` (atomically)."""
        with self._stages.timed(Stage.SAVE):
            position = self._stages.ahead.position(self.step_index) or self._prompts.position()
            return save_run(self.run_dir, self._groups, self._state, position, self.config)

    def load(self, checkpoint: str | os.PathLike[str] | None = None) -> int:
        """Restore roles and controller state from ``checkpoint`` (default: the run's latest); returns its step."""
        path = Path(checkpoint) if checkpoint is not None else checkpointing.latest(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint under {self.run_dir / 'checkpoints'}")
        load_run(path, self._groups, self._state, self._prompts)
        self._stages.rollout_sync.reset()  # the rollout group gets the loaded weights before it generates again
        self._stages.ahead.reset()
        self._replays.forget_policy()
        self._loop.forget_steps_after(self.step_index)
        return self.step_index

    def __repr__(self) -> str:
        groups = ", ".join(f"{role}: {group.world_size} ranks" for role, group in self.groups.items()) or "stopped"
        return (f"Lab({self.name!r}, {self.config.algorithm.name}, step {self.step_index}; {groups}; "
                f"model: {model_summary(self.config)})")
