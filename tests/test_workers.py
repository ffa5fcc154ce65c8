"""The RLHF roles on real ranks: generation, log-prob agreement, updates that move log-probs, checkpoints."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.config import (
    AlgorithmConfig,
    BatchConfig,
    EngineConfig,
    LabConfig,
    OptimConfig,
    RoleConfig,
    RolloutConfig,
)
from hybridflow_lab.controller import ResourcePool, Role, WorkerCallError, WorkerGroup
from hybridflow_lab.models import char_tokenizer, load_causal_lm, save_model_dir
from hybridflow_lab.models.heads import last_token_scores, load_scalar_model
from hybridflow_lab.tasks.prompts import encode_prompts
from hybridflow_lab.workers import ActorWorker, CriticWorker, RewardModelWorker, rule_scores

PROMPTS = ["1+2=", "30+4=", "5+60=", "7+8="]


MODEL_SEED = 9  # conftest's model_dir builds this module's tiny model with it


def lab_config(model_dir: str, backend: str = "ray", engine: str = "deepspeed", stage: int = 2, ranks: int = 2,
               lr: float = 5e-3, kl_loss_coef: float = 0.1, loss_agg: str = "auto") -> LabConfig:
    """Roles on ``model_dir``; with a KL term by default, so that the actor holds a reference policy."""
    role = RoleConfig(model_path=model_dir, ranks=ranks, engine=EngineConfig(backend=engine, zero_stage=stage),
                      optim=OptimConfig(lr=lr, grad_clip=10.0))
    return LabConfig(backend=backend, actor=role, critic=role,
                     algorithm=AlgorithmConfig(kl_loss_coef=kl_loss_coef, loss_agg=loss_agg),
                     rollout=RolloutConfig(max_prompt_tokens=8, max_new_tokens=6),
                     batch=BatchConfig(rollout_batch_prompts=4, samples_per_prompt=2, update_minibatch_sequences=8,
                                       micro_batch_sequences_per_rank=2))


def actor_group(config: LabConfig, *args, **kwargs) -> WorkerGroup:
    return WorkerGroup(Role(ActorWorker, config), *args, meshes=ActorWorker.meshes(config), **kwargs)


def prompts(ground_truths=None) -> DataBatch:
    return encode_prompts(char_tokenizer(), PROMPTS, 8, ground_truths)


def check_actor_round(actor: WorkerGroup) -> None:
    """Generate, check log-prob agreement, update with +/- advantages and check the log-probs move."""
    rollout = actor.generate_sequences(prompts(["3", "34", "65", "15"]))
    assert len(rollout) == 8 and rollout["responses"].shape == (8, 6)
    assert list(rollout["prompt_text"][:2]) == ["1+2=", "1+2="] and len(rollout["response_text"]) == 8
    before = actor.compute_log_prob(rollout)
    torch.testing.assert_close(before["old_log_probs"], rollout["rollout_log_probs"], rtol=1e-5, atol=1e-5)
    reference = actor.compute_ref_log_prob(rollout)["ref_log_probs"]
    torch.testing.assert_close(reference, before["old_log_probs"], rtol=1e-5, atol=1e-5)

    sign = torch.tensor([1.0, -1.0] * 4)  # reward the first sample of every prompt, punish the second
    batch = rollout.union(before.select("old_log_probs")).union(
        DataBatch({"advantages": sign[:, None] * rollout["response_mask"]}))
    metrics = actor.update_actor(batch).meta["metrics"]
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr"} <= metrics.keys()
    after = actor.compute_log_prob(rollout)["old_log_probs"]
    mask = rollout["response_mask"].float()
    change = ((after - before["old_log_probs"]) * mask).sum(-1) / mask.sum(-1)
    assert (change[sign > 0] > 0).all() and (change[sign < 0] < 0).all()
    regenerated = actor.generate_sequences(prompts(), greedy=True, n=1)  # generation sees the new weights
    torch.testing.assert_close(actor.compute_log_prob(regenerated)["old_log_probs"],
                               regenerated["rollout_log_probs"], rtol=1e-5, atol=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize(("engine", "stage"), [("deepspeed", 2), ("deepspeed", 3), ("fsdp", 0)])
def test_actor_on_two_ranks(ray_cluster, model_dir, engine, stage):
    config = lab_config(model_dir, engine=engine, stage=stage)
    actor = actor_group(config, ResourcePool(2), name=f"actor-{engine}")
    try:
        check_actor_round(actor)
    finally:
        actor.shutdown()


def test_actor_on_the_local_backend(model_dir):
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1), backend="local")
    check_actor_round(actor)
    actor.shutdown()


def test_one_step_update_without_old_log_probs_matches_the_recomputed_ones(model_dir):
    config = lab_config(model_dir, "local", "torch", ranks=1)  # 8 sequences, 8 per optimizer step
    with_pass, without = (actor_group(config, backend="local") for _ in range(2))
    rollout = with_pass.generate_sequences(prompts(), seed=3)
    advantages = DataBatch({"advantages": torch.linspace(-1, 1, 8)[:, None] * rollout["response_mask"]})
    recomputed = with_pass.update_actor(rollout.union(with_pass.compute_log_prob(rollout).select("old_log_probs"))
                                        .union(advantages)).meta["metrics"]
    on_policy = without.update_actor(rollout.union(advantages)).meta["metrics"]
    assert on_policy.keys() == recomputed.keys() and "actor/entropy" in on_policy
    for key, value in recomputed.items():
        assert on_policy[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(without.compute_log_prob(rollout)["old_log_probs"],
                               with_pass.compute_log_prob(rollout)["old_log_probs"], rtol=1e-5, atol=1e-5)
    with_pass.shutdown()
    without.shutdown()


def test_the_actor_builds_no_reference_policy_without_a_kl_term(model_dir):
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1, kl_loss_coef=0.0), backend="local")
    with pytest.raises(WorkerCallError, match=r"holds no reference policy.*kl_loss_coef or algorithm\.kl_reward_coef"):
        actor.compute_ref_log_prob(actor.generate_sequences(prompts()))
    actor.shutdown()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_clip_fraction_and_entropy_are_token_means_whatever_the_loss_aggregation(model_dir, mode):
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1, loss_agg=mode), backend="local")
    rollout = actor.generate_sequences(prompts(), seed=1)
    current = actor.compute_log_prob(rollout)
    # old log-probs one nat below the current ones: every ratio is e > 1 + clip_high, every token is clipped
    batch = rollout.union(DataBatch({"old_log_probs": current["old_log_probs"] - 1.0,
                                     "advantages": rollout["response_mask"].float()}))
    metrics = actor.update_actor(batch).meta["metrics"]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)
    assert metrics["actor/ppo_kl"] == pytest.approx(-1.0)
    mask = rollout["response_mask"].bool()
    assert metrics["actor/entropy"] == pytest.approx(float(current["entropy"][mask].mean()), rel=1e-4)
    actor.shutdown()


def test_actor_checkpoint_restores_the_policy(model_dir, tmp_path):
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1), backend="local")
    rollout = actor.generate_sequences(prompts())
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    saved = actor.compute_log_prob(rollout)["old_log_probs"]
    batch = rollout.union(DataBatch({"old_log_probs": saved, "advantages": rollout["response_mask"].float()}))
    actor.update_actor(batch)
    assert not torch.allclose(actor.compute_log_prob(rollout)["old_log_probs"], saved)
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(actor.compute_log_prob(rollout)["old_log_probs"], saved)
    actor.shutdown()


def test_critic_values_move_towards_returns(model_dir):
    config = lab_config(model_dir, "local", "torch", ranks=1, lr=1e-3)
    actor = actor_group(config, backend="local")
    critic = WorkerGroup(Role(CriticWorker, config), backend="local")
    rollout = actor.generate_sequences(prompts())
    values = critic.compute_values(rollout)["values"]
    assert torch.equal(values, torch.zeros_like(values))  # the head starts at zero
    returns = rollout["response_mask"].float() * 0.5
    errors = []
    for _ in range(8):
        batch = rollout.union(critic.compute_values(rollout)).union(DataBatch({"returns": returns}))
        metrics = critic.update_critic(batch).meta["metrics"]
        errors.append(metrics["critic/vf_loss"])
    assert errors[-1] < errors[0] / 4


def test_reward_model_scores_the_last_token(model_dir, tmp_path):
    scorer = load_scalar_model(model_dir)
    torch.nn.init.normal_(scorer.score.weight, std=0.5)
    rm_dir = str(save_model_dir(scorer, tmp_path / "rm"))
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1), backend="local")
    rollout = actor.generate_sequences(prompts())
    reward = WorkerGroup(Role(RewardModelWorker, rm_dir, micro_batch=3), backend="local")
    out = reward.compute_rm_score(rollout)
    with torch.no_grad():
        expected = last_token_scores(scorer(rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"]),
                                     rollout["attention_mask"])
    torch.testing.assert_close(out["scores"], expected)
    last = rollout["response_mask"].sum(-1) - 1
    assert torch.equal(out["token_level_scores"].sum(-1), out["scores"])
    assert torch.equal(out["token_level_scores"][torch.arange(8), last], out["scores"])


def test_a_causal_lm_is_refused_as_a_reward_model(model_dir):
    # its zero-initialised head would score every response 0, and PPO would train on nothing
    with pytest.raises(WorkerCallError, match=r"no scalar head \(score.weight\).*would score every response 0"):
        WorkerGroup(Role(RewardModelWorker, model_dir), backend="local")


def test_rule_scores_use_prompt_response_and_truth():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = DataBatch({"response_mask": mask}, {"prompt_text": ["1+2=", "2+2="], "response_text": ["3", "5"],
                                                "ground_truth": ["3", "4"]})
    out = rule_scores(batch, lambda prompt, response, truth: float(response == truth))
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["token_level_scores"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_encode_prompts_names_the_row_that_is_too_long():
    with pytest.raises(ValueError, match=r"prompt row 1 has 9 tokens, more than max_prompt_tokens=8"):
        encode_prompts(char_tokenizer(), ["1+1=", "123+4567="], 8)


def test_rollout_layout_is_what_training_reads(model_dir):
    actor = actor_group(lab_config(model_dir, "local", "torch", ranks=1), backend="local")
    out = actor.generate_sequences(prompts())
    assert torch.equal(out["input_ids"][:, -6:], out["responses"])
    assert torch.equal(out["attention_mask"][:, -6:], out["response_mask"])
    model = load_causal_lm(model_dir)
    assert out["input_ids"].max() < model.config.vocab_size
