"""The run loop: a step is the algorithm's dataflow, then its metrics, capture, evaluation, log and checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from hybridflow_lab.agents.trajectory import episode_scores
from hybridflow_lab.config import LabConfig, to_dict
from hybridflow_lab.dataflows import Metrics
from hybridflow_lab.dataflows.pending import resolve
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.base import Example
from hybridflow_lab.telemetry import DataflowGraph, JsonlSink, TelemetryStore, sample_rows
from hybridflow_lab.trainer.capture import capture_step
from hybridflow_lab.trainer.metrics import accuracy, data_metrics, throughput
from hybridflow_lab.trainer.run_log import MetricsLog
from hybridflow_lab.trainer.run_stages import RunStages
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.workers import rule_scores

EVAL_AGENT_METRICS = ("agent/tool_use", "agent/calls/ok_share", "agent/turns/mean", "agent/solved",
                      "agent/turns_to_solve")

Listener = Callable[[dict[str, float]], None]
SPANS = "spans.jsonl"  # every span of the run, whatever the telemetry store keeps in memory


class RunLoop:
    """Runs steps and keeps what they leave: ``history`` (each step's metrics, with its ``step``), ``samples`` (a few
    rows of each step's batch), ``last_batch``, ``last_eval``; ``log`` writes them to the run directory (and wandb)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.history: list[dict[str, float]] = []
        self.samples: list[dict[str, Any]] = []
        self.last_batch: DataBatch | None = None
        self.last_eval: DataBatch | None = None  # the last evaluation's greedy responses and scores
        self.listeners: list[Listener] = []
        self.log: MetricsLog | None = None
        self.spans: JsonlSink | None = None

    def step(self, stages: RunStages, overlapped: Callable[[bool], AbstractContextManager[None]],
             graph: Callable[[int], DataflowGraph], captured: list[str], save: Callable[[], Path]) -> Metrics:
        """One iteration of ``stages.needs.algorithm``'s dataflow (its stages ``overlapped`` when
        ``trainer.overlap``); its metrics, logged, with the step's evaluation and checkpoint when they are due."""
        config, state = stages.config, stages.state
        step = stages.begin_step()
        start = time.perf_counter()
        with overlapped(config.trainer.overlap):
            pending, metrics = stages.needs.algorithm.dataflow(stages, step)
        batch = resolve(pending)
        seconds = time.perf_counter() - start
        metrics = {**metrics, **data_metrics(batch, config.rollout.max_new_tokens), **throughput(batch, seconds),
                   "timing_s/step": seconds, "train/accuracy": accuracy(batch["scores"])}
        trainer = config.trainer
        if captured:
            capture_step(self.run_dir, state.step_index + 1, batch, graph(state.step_index), captured,
                         trainer.capture_steps)
        state.step_index += 1
        self.last_batch = batch
        if trainer.eval_every and state.step_index % trainer.eval_every == 0:
            metrics.update(self.evaluate(stages))
        self.record(state.step_index, metrics, batch, trainer.logged_samples)
        if trainer.save_every and state.step_index % trainer.save_every == 0:
            save()
        for listener in list(self.listeners):
            listener(metrics)
        return metrics

    def record(self, step: int, metrics: Metrics, batch: DataBatch, rows: int) -> None:
        self.history.append({"step": step, **metrics})
        samples = [{"step": step, **row} for row in sample_rows(batch, rows)]
        self.samples.extend(samples)
        if self.log is not None:
            self.log.log(step, metrics)
            self.log.log_samples(step, samples)

    def evaluate(self, stages: RunStages, examples: list[Example] | None = None) -> dict[str, float]:
        """Greedy accuracy, mean score and mean response length (tokens) on ``examples`` (default: the task's
        held-out ones), and for a task with tools how its episodes used them (``eval/agent/...``); the responses and
        their scores stay in ``last_eval``."""
        examples = examples if examples is not None else stages.task.eval_examples
        with stages.timed(Stage.EVALUATE):
            prompts, actor = stages.prompts.encode(examples), stages.group("actor")
            agent: Metrics = {}
            if stages.task.agent is not None:  # whole episodes, scored by their environments
                out, episodes = stages.episodes(actor, prompts, 1, greedy=True, seed=0)
                scores = episode_scores(out["turn_rewards"])
                agent = {f"eval/{k}": episodes[k] for k in EVAL_AGENT_METRICS if k in episodes}
            else:
                out = actor.generate_sequences(prompts, greedy=True, n=1, seed=0)
                scores = rule_scores(out, stages.task.reward, stages.reward_guard)["scores"]
        self.last_eval = out.union(DataBatch({"scores": scores}))
        return {"eval/accuracy": accuracy(scores), "eval/score": float(scores.mean()),
                "eval/response_length": float(out["response_mask"].sum(-1).float().mean()), **agent}

    def run(self, steps: int, step: Callable[[], Metrics], config: LabConfig, name: str) -> list[Metrics]:
        """``steps`` calls of ``step`` with a progress bar; their metrics."""
        from tqdm.auto import tqdm

        results = []
        with tqdm(total=steps, disable=not config.trainer.progress, desc=name, unit="step", mininterval=2.0) as bar:
            for _ in range(steps):
                metrics = step()
                results.append(metrics)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}", acc=f"{metrics['train/accuracy']:.2f}")
                bar.update()
        return results

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self.listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self.listeners:
                self.listeners.remove(listener)

        return unsubscribe

    def open_logs(self, config: LabConfig, telemetry: TelemetryStore) -> None:
        """Log to the run directory: metrics and samples (and wandb with ``trainer.wandb``), every span."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.spans = JsonlSink(self.run_dir / SPANS).attach(telemetry)
        self.log = MetricsLog(self.run_dir, config.trainer.wandb_project if config.trainer.wandb else None,
                              to_dict(config))

    def close_logs(self) -> None:
        for closable in (self.log, self.spans):
            if closable is not None:
                closable.close()
        self.log, self.spans = None, None

    def forget_steps_after(self, step: int) -> None:
        """Drop the metrics and samples of steps after ``step`` (they are replayed from there)."""
        self.history = [m for m in self.history if m["step"] <= step]
        self.samples = [row for row in self.samples if row["step"] <= step]
        if self.log is not None:
            self.log.truncate_after(step)
