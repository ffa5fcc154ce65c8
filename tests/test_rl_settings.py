"""Each documented RL setting does what it says in a Lab: the KL in the rewards reaches every estimator, Safe-RLHF's
KL sides, numerically safe losses, the modern losses, and the rollout/training mismatch reported and corrected."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.algorithms import get_advantage_estimator, kl_estimate
from hybridflow_lab.algorithms.masked import token_level
from hybridflow_lab.dataflows import ALGORITHMS
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_stages import TRAINING_COLUMNS

BETA = 0.5
PROMPTS, SAMPLES, LENGTH = 4, 4, 5


MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it


def local_overrides(model_dir, run_dir, *extra):
    return ("backend=local", f"actor.model_path={model_dir}", "actor.ranks=1", "critic.ranks=1",
            "actor.engine.backend=torch", "critic.engine.backend=torch", "actor.optim.lr=1e-3",
            f"trainer.run_dir={run_dir}", "trainer.progress=false", f"batch.rollout_batch_prompts={PROMPTS}",
            f"batch.samples_per_prompt={SAMPLES}", "batch.update_minibatch_sequences=16",
            "batch.micro_batch_sequences_per_rank=8", "task.eval_size=8", f"rollout.max_new_tokens={LENGTH}", *extra)


def scored_batch(seed: int = 0) -> DataBatch:
    """A random scored batch as the advantage stage receives it: masks, scores, costs, log-probs, greedy baselines."""
    generator = torch.Generator().manual_seed(seed)
    rows = PROMPTS * SAMPLES
    lengths = torch.randint(1, LENGTH + 1, (rows,), generator=generator)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    log_probs = -torch.rand(rows, LENGTH, generator=generator) * mask
    scores = torch.rand(rows, generator=generator)
    return DataBatch({
        "response_mask": mask, "scores": scores, "token_level_scores": token_level(scores, mask),
        "costs": (torch.rand(rows, generator=generator) > 0.5).float(), "old_log_probs": log_probs,
        "ref_log_probs": log_probs - torch.randn(rows, LENGTH, generator=generator) * mask,
        "baseline_scores": torch.rand(rows, generator=generator),
    }, {"uid": np.repeat(np.arange(PROMPTS), SAMPLES)})


SEQUENCE_LEVEL = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "remax", "safe_rlhf"]


@pytest.mark.parametrize("algorithm", SEQUENCE_LEVEL)
def test_kl_in_reward_changes_group_advantages(model_dir, tmp_path, algorithm):
    """verl's rule: a sequence-level estimator sees score - beta * (sum of the sequence's token KLs)."""
    extra = (f"algorithm.name={algorithm}", "task.cost=digit_cost")
    plain = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "a", *extra), start=False)
    penalised = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "b", *extra, f"algorithm.kl_reward_coef={BETA}"), start=False)
    batch = scored_batch()
    after_penalty = penalised.advantages(penalised.kl_penalty(batch))["advantages"]
    moved = (after_penalty - plain.advantages(batch)["advantages"]).abs()
    mask = batch["response_mask"].bool()
    assert float(moved[mask].mean()) > 0.1  # main moved them by exactly 0
    kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k1") * batch["response_mask"]
    expected, _ = get_advantage_estimator(ALGORITHMS[algorithm].estimator)(
        token_rewards=None, scores=batch["scores"] - BETA * kl.sum(-1), values=None, mask=batch["response_mask"],
        group_ids=torch.as_tensor(batch["uid"]), baseline_scores=batch["baseline_scores"], gamma=1.0, lam=1.0)
    torch.testing.assert_close(after_penalty, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"has no token_rewards: call lab.kl_penalty\(batch\) first"):
        penalised.advantages(batch)  # without the penalty the KL setting would do nothing: refused


def test_safe_rlhf_adds_the_kl_to_the_costs_and_moves_the_controller_once(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "run", "algorithm.name=safe_rlhf", "task.cost=digit_cost",
        f"algorithm.kl_reward_coef={BETA}", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100"), start=False)
    batch = scored_batch(1)
    mask = batch["response_mask"]
    kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k1") * mask
    penalised = lab.kl_penalty(batch)  # the rewards lose the KL, the costs gain it, with the same coefficient
    torch.testing.assert_close(penalised["token_costs"], token_level(batch["costs"], mask) + BETA * kl)
    torch.testing.assert_close(penalised["token_rewards"], token_level(batch["scores"], mask) - BETA * kl)
    costs = lab.advantages(penalised, scores="costs")
    torch.testing.assert_close(costs["token_costs"], penalised["token_costs"])  # what the cost estimator saw
    mean_kl = float((kl.sum(-1) / mask.sum(-1)).mean())
    error = min(max(mean_kl / 0.01 - 1, -0.2), 0.2)
    assert lab.kl.value == pytest.approx(BETA * (1 + error * len(batch) / 100), rel=1e-12)  # one update


def test_safe_rlhf_step_updates_the_adaptive_controller_once(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "run", "algorithm.name=safe_rlhf", "task.cost=digit_cost", "algorithm.kl_reward_coef=0.1",
        "algorithm.kl_target=6.0", "algorithm.kl_horizon=1000"))
    metrics = lab.step()
    error = min(max(metrics["actor/reward_kl_penalty"] / 6.0 - 1, -0.2), 0.2)
    assert lab.kl.value == pytest.approx(0.1 * (1 + error * PROMPTS * SAMPLES / 1000), rel=1e-12)
    lab.shutdown()


def test_remax_keeps_advantages_in_float32(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=remax"))
    lab.step()
    assert lab.last_batch["baseline_scores"].dtype == torch.float32
    assert lab.last_batch["advantages"].dtype == torch.float32
    lab.shutdown()


def test_a_huge_log_ratio_on_a_padding_token_does_not_stop_the_update(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.kl_loss_coef=0.1",
                                                          "rollout.ignore_eos=true"))
    batch = lab.ref_log_prob(lab.reward(lab.generate(lab.next_prompts())))
    batch["response_mask"][:, -1] = 0  # the last position becomes padding, as for a response that stopped early
    batch["ref_log_probs"][:, -1] = 100.0  # a log-ratio of -100 there: k3's exp(100) before the fix
    metrics = lab.update_actor(lab.advantages(batch))
    assert metrics["actor/nonfinite_skipped"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    lab.shutdown()


@pytest.mark.parametrize(("policy_loss", "algorithm", "aggregation"), [
    ("gspo", "grpo", "seq-mean-token-mean"), ("cispo", "grpo", "token-mean"), ("ppo", "dr_grpo",
                                                                               "seq-mean-token-sum-norm")])
def test_the_modern_losses_train_with_their_papers_aggregation(model_dir, tmp_path, policy_loss, algorithm,
                                                                aggregation):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "run", f"algorithm.policy_loss={policy_loss}", f"algorithm.name={algorithm}",
        "batch.update_minibatch_sequences=8"))  # two optimizer steps: the second one's ratios are not 1
    assert lab.config.algorithm.aggregation == aggregation
    batch = lab.advantages(lab.old_log_prob(lab.reward(lab.generate(lab.next_prompts()))))
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(0)) \
        * batch["response_mask"]
    before = lab.old_log_prob(batch.select(*TRAINING_COLUMNS))["old_log_probs"]
    metrics = lab.update_actor(batch)
    assert all(math.isfinite(v) for v in metrics.values()) and 0 <= metrics["actor/pg_clipfrac"] <= 1
    assert not torch.equal(lab.old_log_prob(batch.select(*TRAINING_COLUMNS))["old_log_probs"], before)
    lab.shutdown()


def test_mismatch_between_rollout_and_training_is_reported_and_corrected(model_dir, tmp_path):
    """Top-k sampling draws from a truncated distribution: its log-probs are above the trainer's full-softmax ones,
    every importance weight pi_train / pi_rollout is below 1 (TIS caps none), and a band above 1 masks every token."""
    reported = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "a", "rollout.top_k=3",
                                                               "algorithm.rollout_is=token"))
    metrics = reported.step()
    assert 0 < metrics["actor/rollout_mismatch"] <= metrics["actor/rollout_mismatch_max"]
    assert metrics["actor/rollout_is_weight"] < 1 and metrics["actor/rollout_is_capped"] == 0
    assert metrics["actor/rollout_is_masked"] == 0
    reported.shutdown()
    masked = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "b", "rollout.top_k=3", "algorithm.rollout_mask=token", "algorithm.rollout_mask_low=1.0",
        "algorithm.rollout_mask_high=2.0"))
    metrics = masked.step()
    assert metrics["actor/rollout_is_masked"] == 1.0 and metrics["actor/pg_loss"] == 0.0
    masked.shutdown()
    on_policy = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "c"))
    assert on_policy.step()["actor/rollout_mismatch_max"] < 1e-4  # same weights, same kernels: no gap
    on_policy.shutdown()
