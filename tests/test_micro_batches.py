"""Token-budget micro-batches (verl's dynamic batch size): balanced parts that fit the budget, outputs back in row
order, and optimizer steps equal to fixed-size micro-batches even when ranks need different counts."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.config import BatchConfig
from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.smoke.checks import sequences
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.workers.batching import balanced_parts, fewest_parts, micro_batches
from tests.engine_workers import EngineProbe
from tests.test_lab import local_overrides
from tests.test_packing import LONG_RESPONSE_LENGTHS, ragged_batch

NATURAL = [18, 19, 21, 24, 28, 33, 39, 46, 54, 63, 73, 84, 96, 110, 126, 144]  # bench e2e natural's rows


def test_parts_fit_the_budget_hold_every_row_once_and_are_the_fewest():
    for budget in (144, 200, 300, 500, 2000):
        count = fewest_parts(NATURAL, budget)
        parts = balanced_parts(NATURAL, count)
        assert sorted(row for part in parts for row in part) == list(range(len(NATURAL)))
        assert max(sum(NATURAL[r] for r in part) for part in parts) <= budget
        fewer = balanced_parts(NATURAL, count - 1) if count > 1 else None
        assert fewer is None or max(sum(NATURAL[r] for r in part) for part in fewer) > budget
        assert all(part == sorted(part) and part for part in parts)
    assert fewest_parts(NATURAL, 2000) == 1
    assert fewest_parts(NATURAL, 300) == 4  # 1078 tokens: the lower bound ceil(1078 / 300) is reached
    assert fewest_parts([50, 400, 60], 100) == 3  # a row longer than the budget goes alone


def test_outputs_of_token_micro_batches_come_back_in_row_order(tmp_path):
    model = load_causal_lm(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=1))
    batch = ragged_batch(model.config.vocab_size, response_lengths=LONG_RESPONSE_LENGTHS)
    micros = micro_batches(batch, BatchConfig(micro_batch_tokens_per_rank=120))
    assert len(micros.parts) > 1 and not torch.equal(micros.order, torch.arange(len(batch)))  # really reordered
    with torch.no_grad():
        whole, _ = response_log_probs(model, batch)
        parts = micros.in_row_order([response_log_probs(model, part)[0] for part in micros.parts])
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-5)


MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it


@pytest.mark.ray
@pytest.mark.parametrize(("backend", "stage"), [("deepspeed", 2), ("torch", 0)], ids=["deepspeed2", "torch"])
def test_token_micro_batches_train_as_fixed_ones_when_ranks_need_different_counts(ray_cluster, model_dir, backend,
                                                                                     stage):
    batch, budget = sequences(), 30
    tokens = batch["attention_mask"].sum(-1).tolist()
    assert (fewest_parts(tokens[:4], budget), fewest_parts(tokens[4:], budget)) == (2, 3)  # rank 0's, rank 1's
    reference = WorkerGroup(Role(EngineProbe, model_dir, "torch", micro_batches=4), backend="local")
    expected = reference.train(batch, steps=3).meta["losses"]
    reference.shutdown()
    group = WorkerGroup(Role(EngineProbe, model_dir, backend, zero_stage=stage), ResourcePool(2))
    try:
        out = group.train_by_tokens(batch, steps=3, budget=budget)
        assert out.meta["micro_batches"] == [3, 3, 3]  # both ranks run the larger count
        assert out.meta["losses"] == pytest.approx(expected, rel=1e-5)
        assert expected[-1] < expected[0] - 0.5
    finally:
        group.shutdown()


def test_a_ppo_step_with_token_micro_batches_equals_one_with_sequence_micro_batches(tmp_path):
    """Actor, critic and reference passes all split by tokens: the same losses, values and KL as by sequences."""
    model = str(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=11))
    metrics = []
    for name, split in (("sequences", "batch.micro_batch_tokens_per_rank=0"),
                        ("tokens", "batch.micro_batch_tokens_per_rank=60")):
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model, tmp_path / name, "algorithm.name=ppo",
                                                              "algorithm.kl_loss_coef=0.1", split))
        try:
            metrics.append(lab.step())
        finally:
            lab.shutdown()
    by_sequences, by_tokens = metrics
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "critic/vf_loss", "critic/values/mean",
                "actor/grad_norm"):
        assert by_tokens[key] == pytest.approx(by_sequences[key], rel=1e-5, abs=1e-7), key
