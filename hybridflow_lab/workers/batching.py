"""Splitting a rank's share of a step into mini-batches (one optimizer step each) and micro-batches, and the steps'
metrics into one."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from hybridflow_lab.config import BatchConfig
from hybridflow_lab.engines.train_base import TrainEngine
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.seeds import derive_seed


def per_rank_minibatch(batch: BatchConfig, ranks: int) -> int:
    """Sequences one rank contributes to each optimizer step."""
    return batch.update_minibatch_sequences // ranks


def minibatches(rows: DataBatch, size: int, epochs: int, seed: int) -> Iterator[DataBatch]:
    """``epochs`` passes over ``rows`` in a seeded random order, ``size`` rows at a time."""
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
        order = torch.randperm(len(rows), generator=generator, device="cpu")  # the same on every device; indexes any
        yield from rows.reorder(order).split(size)


def optimizer_steps(rows: DataBatch, batch: BatchConfig, ranks: int, seed: int, engine: TrainEngine
                    ) -> Iterator[list[DataBatch]]:
    """The micro-batches of each optimizer step over a rank's ``rows``: ``batch.update_epochs`` passes in an order
    drawn from ``seed``, ``per_rank_minibatch`` rows a step (collective under token budgets, ``micro_batches``)."""
    for mini in minibatches(rows, per_rank_minibatch(batch, ranks), batch.update_epochs, seed):
        yield micro_batches(mini, batch, engine).parts


@dataclass
class MicroBatches:
    """A rank's rows split for its forward and backward passes."""

    parts: list[DataBatch]
    order: torch.Tensor  # the row of ``rows`` each part's rows come from, part after part

    def in_row_order(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parts' outputs (one row per row) concatenated and put back in the rows' order."""
        out = torch.cat(list(outputs))
        restored = torch.empty_like(out)
        restored[self.order.to(out.device)] = out
        return restored


def micro_batches(rows: DataBatch, batch: BatchConfig, engine: TrainEngine | None = None) -> MicroBatches:
    """``rows`` split ``batch.micro_batch_sequences_per_rank`` sequences at a time or, with
    ``batch.micro_batch_tokens_per_rank``, into the fewest micro-batches of at most that many real tokens, the tokens
    balanced between them (a row longer than the budget goes alone). With ``engine`` (a training step, collective)
    every data-parallel rank runs as many micro-batches as the rank that needs the most."""
    budget = batch.micro_batch_tokens_per_rank
    if budget <= 0:
        return MicroBatches(rows.split(batch.micro_batch_sequences_per_rank), torch.arange(len(rows), device="cpu"))
    tokens = rows["attention_mask"].sum(-1).tolist()
    count = fewest_parts(tokens, budget)
    if engine is not None:
        count = engine.max_over_ranks(count)
    parts = balanced_parts(tokens, count)
    order = torch.tensor([row for part in parts for row in part], device="cpu")
    return MicroBatches([rows[part] for part in parts], order)


def balanced_parts(tokens: Sequence[int], count: int) -> list[list[int]]:
    """Row indices in ``count`` parts of near-equal token sums: the longest rows first, each to the lightest part;
    each part's rows in their original order."""
    parts: list[list[int]] = [[] for _ in range(count)]
    sums = [0] * count
    for row in sorted(range(len(tokens)), key=lambda r: -tokens[r]):
        lightest = min(range(count), key=lambda p: (sums[p], len(parts[p])))
        parts[lightest].append(row)
        sums[lightest] += tokens[row]
    return [sorted(part) for part in parts]


def fewest_parts(tokens: Sequence[int], budget: int) -> int:
    """The fewest ``balanced_parts`` whose token sums all fit in ``budget`` (at most one part per row)."""
    count = min(len(tokens), max(1, math.ceil(sum(tokens) / budget)))
    while count < len(tokens) and max(sum(tokens[r] for r in part) for part in balanced_parts(tokens, count)) > budget:
        count += 1
    return count


def mean_over_steps(steps: Sequence[dict[str, float]], maxima: Collection[str] = ()) -> dict[str, float]:
    """The optimizer steps' metrics as one: the mean of each, the largest of the ``maxima``."""
    keys = steps[0].keys() if steps else ()
    return {k: max(m[k] for m in steps) if k in maxima else sum(m[k] for m in steps) / len(steps) for k in keys}
