"""Replaying a captured batch through an algorithm's dataflow: the same rollouts through GRPO, RLOO, GSPO...

``replay`` runs the algorithm's own dataflow function (a notebook's too) on a ``ReplayStages``: its responses
are the captured batch, the stages that had run when it was captured are skipped (their columns are in it),
the later ones run for real (log-probs on the worker groups, KL and advantages on the controller) under the
replay's config, and the actor's update is a probe: the update's loss, diagnostics and gradient norm for the
whole batch as one optimizer step, computed on a copy of the current policy on the controller, so the run's
weights, optimizer and controllers are untouched. The critic is not probed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from hybridflow_lab.algorithms.registry import get_policy_loss
from hybridflow_lab.config import LabConfig
from hybridflow_lab.dataflows import Metrics
from hybridflow_lab.dataflows.pending import resolve
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.trainer.stages import Stage
from hybridflow_lab.workers.actor_loss import actor_token_loss
from hybridflow_lab.workers.batching import TokenLoss, train_minibatches

if TYPE_CHECKING:
    from hybridflow_lab.trainer.lab import Lab

STAGE_OF_METHOD = {  # the Lab's stage methods a replay may skip, and the stage each is
    "reward": Stage.REWARD, "shape_rewards": Stage.SHAPE_REWARDS, "old_log_prob": Stage.OLD_LOG_PROB,
    "ref_log_prob": Stage.REF, "values": Stage.VALUES, "kl_penalty": Stage.KL_PENALTY, "advantages": Stage.ADV,
}
ROW = "replay_row"  # each row's index, carried through the probe's shuffled micro-batches


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


class ReplayStages:
    """The stages a replayed dataflow calls: the Lab's, except that its responses are the captured batch, the
    stages in ``skipped`` return their input, and ``update_actor`` is ``probe``."""

    def __init__(self, lab: Lab, batch: DataBatch, skipped: set[str], probe: Callable[[DataBatch], Metrics]) -> None:
        self._lab, self._batch, self._skipped, self._probe = lab, batch, skipped, probe

    def rollout(self) -> DataBatch:
        return self._batch

    def next_prompts(self, n: int | None = None) -> DataBatch:
        raise ReplayError("this dataflow draws prompts or generates of its own (ReMax's greedy baseline does); a "
                          "replay takes only the captured responses")

    generate = next_prompts

    def update_actor(self, batch: DataBatch) -> Metrics:
        return self._probe(resolve(batch))

    def update_critic(self, batch: DataBatch) -> Metrics:
        return {}

    def __getattr__(self, name: str) -> Any:
        stage = STAGE_OF_METHOD.get(name)
        if stage is not None and stage.value in self._skipped:
            return lambda batch, *args, **kwargs: batch
        return getattr(self._lab, name)


def replay_batch(lab: Lab, batch: DataBatch, record: dict[str, Any], config: LabConfig, policy: torch.nn.Module,
                 name: str, overrides: tuple[str, ...]) -> Replayed:
    """``batch`` (captured after ``record["stage"]`` of step ``record["step"]``) through the dataflow of ``config``,
    with ``policy`` probed for the update; the Lab is inside ``Lab._replaying`` (see the module docstring)."""
    needs = lab.needs
    if needs.critic and "critic" not in lab.groups:
        raise ReplayError(f"{needs.algorithm.name} needs a critic and this Lab runs none; replay it in a Lab that "
                          "runs PPO")
    order = record["stages"]
    skipped = set(order[: order.index(record["stage"]) + 1])
    losses: dict[int, torch.Tensor] = {}
    step = lab.current_step

    def probe(rows: DataBatch) -> Metrics:
        metrics, per_row = probe_update(policy, rows, config)
        losses.update(per_row)
        return step.record(metrics)

    final, metrics = needs.algorithm.dataflow(ReplayStages(lab, batch, skipped, probe), step)
    final = resolve(final)
    width = final["responses"].shape[1]
    token_loss = torch.stack([losses.get(row, torch.zeros(width)) for row in range(len(final))])
    return Replayed(name, overrides, record["step"], record["stage"], final, dict(metrics), token_loss,
                    sorted(skipped, key=order.index))


def probe_update(model: torch.nn.Module, batch: DataBatch, config: LabConfig
                 ) -> tuple[Metrics, dict[int, torch.Tensor]]:
    """The actor update's metrics on ``batch`` taken as one optimizer step (one epoch, one mini-batch) by ``model``,
    without applying it; and each row's policy loss per token."""
    algorithm = config.algorithm
    loss = actor_token_loss(config, get_policy_loss(algorithm.policy_loss), algorithm.kl_loss_coef)
    per_row: dict[int, torch.Tensor] = {}

    def recording(module: torch.nn.Module, micro: DataBatch) -> TokenLoss:
        out = loss(module, micro)
        for row, values in zip(micro[ROW].tolist(), out.terms["pg_loss"].detach(), strict=True):
            per_row[row] = values
        return out

    rows = batch.union(DataBatch({ROW: torch.arange(len(batch))}))
    one_step = replace(config, batch=replace(config.batch, update_minibatch_sequences=len(batch), update_epochs=1))
    engine = TorchEngine(model, config.actor.optim)
    metrics = train_minibatches(engine, rows, one_step, 1, config.seed, recording, apply=False)
    return {f"actor/{k}": v for k, v in metrics.items() if k not in ("loss", "lr", "nonfinite_skipped")}, per_row


def policy_copy(path: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A float32 model of ``path``'s architecture holding ``weights`` (the policy's, as the actor gathers them)."""
    model = load_causal_lm(path)
    model.load_state_dict(weights)
    return model
