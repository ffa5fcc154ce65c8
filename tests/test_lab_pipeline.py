"""The Lab with the actor trained in pipeline stages: the same run as without them, and a layout it moves into and
out of with its optimizer state."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.config.bounds import setting
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_stages import TRAINING_COLUMNS
from tests.test_lab import local_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL_SEED = 7  # conftest's model_dir builds this module's tiny model (4 layers) with it
CURVE = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/score/mean",
         "response_length/mean")
STAGES = ("actor.engine.pipeline_parallel=2",)


def ray_overrides(model_dir, run_dir, ranks, *extra):
    """A Ray Lab on ``ranks`` ranks, the torch engine on padded passes (what pipeline stages run)."""
    local = [o for o in local_overrides(model_dir, run_dir, "algorithm.kl_loss_coef=0.1")
             if o not in ("backend=local", "actor.ranks=1", "critic.ranks=1")]
    return (*local, f"actor.ranks={ranks}", f"critic.ranks={ranks}", "actor.engine.remove_padding=false", *extra)


def run_curve(model_dir, run_dir, *layout):
    """Three PPO steps, one optimizer step each (the data-parallel ranks would otherwise draw their mini-batches
    from their own halves of the batch)."""
    lab = Lab("arithmetic_grpo", overrides=ray_overrides(model_dir, run_dir, 2, "algorithm.name=ppo",
                                                         "batch.update_minibatch_sequences=16", *layout))
    lab.task.reward = lambda prompt, response, truth: len(set(response)) / 5  # every step trains
    try:
        return [lab.step() for _ in range(3)], lab.actor.policy_weights()[0]
    finally:
        lab.shutdown()


def test_ppo_with_the_actor_in_two_pipeline_stages_follows_the_data_parallel_runs_curve(ray_cluster, model_dir,
                                                                                       tmp_path):
    expected, expected_weights = run_curve(model_dir, tmp_path / "d2")
    curve, weights = run_curve(model_dir, tmp_path / "p2", *STAGES)
    for step, (got, want) in enumerate(zip(curve, expected, strict=True), start=1):
        for key in CURVE:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), f"step {step} {key}"
    assert set(weights) == set(expected_weights)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_weights[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_lab_moves_from_pipeline_and_tensor_parallel_to_tensor_and_data_parallel_and_back(ray_cluster, model_dir,
                                                                                           tmp_path):
    lab = Lab("arithmetic_grpo", overrides=ray_overrides(model_dir, tmp_path / "run", 4, "actor.engine.backend=torch",
                                                         "actor.engine.tensor_parallel=2", *STAGES))
    try:
        lab.run(2)
        fixed = lab.generate(lab.next_prompts()).select(*TRAINING_COLUMNS)
        for layout in (("actor.engine.pipeline_parallel=1",), STAGES):  # p2 t2 -> t2 d2 -> p2 t2
            before = lab.old_log_prob(fixed)["old_log_probs"]
            state = lab.actor.training_state()[0]
            done = lab.reconfigure(*layout)
            assert set(done.carried) == {"actor"} and done.checkpoint.endswith(f"step_{lab.step_index:06d}")
            assert all(str(setting(lab.config, key)) == value for key, value in (o.split("=") for o in layout))
            torch.testing.assert_close(lab.old_log_prob(fixed)["old_log_probs"], before, rtol=0, atol=1e-5)
            after = lab.actor.training_state()[0]
            assert after.global_step == state.global_step and after.scheduler == state.scheduler
            for name, moments in state.moments.items():
                for key, value in moments.items():
                    torch.testing.assert_close(after.moments[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
            assert "actor/pg_loss" in lab.step()
        assert lab.step_index == 4
    finally:
        lab.shutdown()
