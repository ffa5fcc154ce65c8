"""Splitting a rank's share of a step into mini-batches (one optimizer step each) and micro-batches."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridflow_lab.algorithms.losses import aggregate
from hybridflow_lab.config import BatchConfig, LabConfig
from hybridflow_lab.engines.train_base import LossFn, TrainEngine
from hybridflow_lab.protocol import DataBatch


def per_rank_minibatch(batch: BatchConfig, ranks: int) -> int:
    """Sequences one rank contributes to each optimizer step."""
    return batch.update_minibatch_sequences // ranks


def minibatches(rows: DataBatch, size: int, epochs: int, seed: int) -> Iterator[DataBatch]:
    """``epochs`` passes over ``rows`` in a seeded random order, ``size`` rows at a time."""
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        yield from rows.reorder(order).split(size)


def micro_batches(rows: DataBatch, size: int) -> list[DataBatch]:
    return rows.split(size)


def average(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over optimizer steps."""
    keys = metrics[0].keys() if metrics else ()
    return {k: sum(m[k] for m in metrics) / len(metrics) for k in keys}


def train_minibatches(engine: TrainEngine, rows: DataBatch, config: LabConfig, ranks: int, seed: int,
                      token_loss: LossFn) -> dict[str, float]:
    """One optimizer step per mini-batch of ``rows`` (this rank's share); the steps' mean metrics.

    ``token_loss`` returns the loss and metrics per response token (``[rows, length]``); they are
    aggregated with ``algorithm.loss_agg``, and the engine averages by that mode's units (tokens
    or sequences) over all micro-batches and ranks.
    """
    batch, mode = config.batch, config.algorithm.loss_agg

    def loss(module: torch.nn.Module, micro: DataBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro["response_mask"]
        value, metrics = token_loss(module, micro)
        return aggregate(value, mask, mode)[0], {k: aggregate(v, mask, mode)[0] for k, v in metrics.items()}

    def units(micro: DataBatch) -> float:
        mask = micro["response_mask"]
        return aggregate(torch.zeros(mask.shape), mask, mode)[1]

    skip_nonfinite = config.trainer.on_nonfinite == "skip"
    steps = []
    for mini in minibatches(rows, per_rank_minibatch(batch, ranks), batch.update_epochs, seed):
        steps.append(engine.train_step(micro_batches(mini, batch.micro_batch_sequences_per_rank), loss, units,
                                       skip_nonfinite))
    return average(steps)
