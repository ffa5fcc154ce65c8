"""Re-placing or re-sizing a running Lab loses nothing: weights, optimizer state, schedule and step carry over."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_stages import TRAINING_COLUMNS
from tests.test_lab import local_overrides

NEXT_STEP = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss",
             "response_length/mean")


MODEL_SEED = 6  # conftest's model_dir builds this module's tiny model with it


def ppo(model_dir, run_dir, *extra):
    return local_overrides(model_dir, run_dir, "algorithm.name=ppo", "algorithm.kl_loss_coef=0.1",
                           "batch.micro_batch_sequences_per_rank=8", "actor.optim.lr=5e-3", *extra)


def ppo_lab(model_dir, run_dir):
    """A PPO Lab whose reward a random policy earns in varying amounts (the distinct characters it writes), so
    that every step trains."""
    lab = Lab("arithmetic_grpo", overrides=ppo(model_dir, run_dir))
    lab.task.reward = lambda prompt, response, truth: len(set(response)) / 5
    return lab


def test_reconfiguring_a_running_lab_carries_its_trained_steps(model_dir, tmp_path):
    probe = Lab("arithmetic_grpo", overrides=ppo(model_dir, tmp_path / "probe"))
    fixed = probe.generate(probe.next_prompts()).select(*TRAINING_COLUMNS)  # a batch from the initial policy
    initial = probe.old_log_prob(fixed)["old_log_probs"]
    probe.shutdown()

    straight = ppo_lab(model_dir, tmp_path / "straight")
    straight.run(3)
    expected_log_probs = straight.old_log_prob(fixed)["old_log_probs"]
    expected_values = straight.values(fixed)["values"]
    expected = straight.step()
    straight.shutdown()

    moved = ppo_lab(model_dir, tmp_path / "moved")
    try:
        moved.run(3)
        done = moved.reconfigure("batch.micro_batch_sequences_per_rank=2")  # what the placement board's Apply does
        assert done.restarted and set(done.carried) == {"actor", "critic"} and done.started_fresh == {}
        assert moved.step_index == 3 and done.checkpoint.endswith("step_000003")
        log_probs = moved.old_log_prob(fixed)["old_log_probs"]
        assert (log_probs - initial).abs().max() > 1e-3  # three trained steps are in the policy
        torch.testing.assert_close(log_probs, expected_log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(moved.values(fixed)["values"], expected_values, rtol=0, atol=1e-5)
        again = moved.step()
        for key in NEXT_STEP:
            assert again[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    finally:
        moved.shutdown()


def test_a_role_that_cannot_carry_its_state_says_so_and_keeps_it_in_the_checkpoint(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.kl_loss_coef=0.1"))
    try:
        lab.step()
        with pytest.warns(UserWarning, match=r"the actor's trained state was not carried over \(its LoRA settings "
                                             r"changed.*\); it is in .*step_000001"):
            done = lab.reconfigure("actor.lora.rank=4")
        assert done.started_fresh == {"actor": "its LoRA settings changed, so its trained tensors did"}
        assert "actor starts from its model path" in str(done)
    finally:
        lab.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("layout", "new_layout"), [
    (("actor.ranks=2", "actor.engine.backend=deepspeed", "actor.engine.zero_stage=2"),
     ("actor.ranks=1", "actor.engine.backend=torch")),
], ids=["zero2-on-2-ranks-to-1-torch-rank"])  # tensor and pipeline parallel: tests/test_lab_pipeline.py
def test_a_ray_lab_moves_to_another_engine_or_parallelism_with_its_optimizer_state(ray_cluster, model_dir, tmp_path,
                                                                                   layout, new_layout):
    overrides = [o for o in local_overrides(model_dir, tmp_path / "run", "algorithm.kl_loss_coef=0.1")
                 if o not in ("backend=local", "actor.ranks=1", "actor.engine.backend=torch")]
    lab = Lab("arithmetic_grpo", overrides=(*overrides, *layout))
    try:
        lab.run(2)
        fixed = lab.generate(lab.next_prompts()).select(*TRAINING_COLUMNS)
        before = lab.old_log_prob(fixed)["old_log_probs"]
        state = lab.actor.training_state()[0]
        done = lab.reconfigure(*new_layout)
        assert set(done.carried) == {"actor"}
        assert (lab.config.actor.ranks, lab.config.actor.engine.backend) == (1, "torch")
        torch.testing.assert_close(lab.old_log_prob(fixed)["old_log_probs"], before, rtol=0, atol=1e-5)
        after = lab.actor.training_state()[0]
        assert after.global_step == state.global_step == 4 and after.scheduler == state.scheduler  # 2 updates a step
        for name, moments in state.moments.items():
            for key, value in moments.items():
                torch.testing.assert_close(after.moments[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
        assert "actor/pg_loss" in lab.step() and lab.step_index == 3
    finally:
        lab.shutdown()
