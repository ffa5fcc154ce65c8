"""One declared Algorithm read by everything that asks what a run needs; the step context; bad declarations."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.config import ConfigError
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.dataflows import ALGORITHMS, AlgorithmError, RunNeeds, StepContext, register_algorithm
from hybridflow_lab.dataflows.builtin import grpo
from hybridflow_lab.placement import Placement
from hybridflow_lab.placement.workload import workload_from_config
from hybridflow_lab.trainer.lab import Lab
from tests.test_lab import local_overrides

MODEL_SEED = 4  # conftest's model_dir builds this module's tiny model with it


def actor_of(lab):
    (actor,) = lab.actor._backend.hosts[0].roles.values()
    return actor


@pytest.mark.parametrize(("extra", "critic", "reference", "reference_model"), [
    (("algorithm.name=grpo",), False, False, False),
    (("algorithm.name=grpo", "algorithm.kl_loss_coef=0.1"), False, True, True),
    (("algorithm.name=grpo", "algorithm.kl_loss_coef=0.1", "actor.lora.rank=4"), False, True, False),
    (("algorithm.name=ppo", "algorithm.kl_reward_coef=0.1"), True, True, True),
], ids=["grpo", "grpo+kl", "grpo+kl+lora", "ppo+kl"])
def test_the_lab_the_workload_and_the_placement_read_one_declaration(model_dir, tmp_path, extra, critic, reference,
                                                                      reference_model):
    overrides = local_overrides(model_dir, tmp_path / "run", *extra)
    needs = RunNeeds.of(resolve_config("arithmetic_grpo", overrides))
    assert (needs.critic, needs.reference, needs.reference_model) == (critic, reference, reference_model)
    lab = Lab("arithmetic_grpo", overrides=overrides)
    try:
        assert lab.needs == needs and ("critic" in lab.groups) is critic
        assert (actor_of(lab).reference is not None) is reference_model  # nothing builds a model no stage uses
        metrics = lab.step()
        assert ("timing_s/ref" in metrics) is reference and ("timing_s/values" in metrics) is critic
        models = set(workload_from_config(lab.config).models)
        assert models == {"actor", *(["critic"] if critic else []), *(["reference"] if reference_model else [])}
        assert set(Placement.from_config(lab.config).assignment) == models
    finally:
        lab.shutdown()


def test_a_notebook_algorithm_declares_what_it_needs(model_dir, tmp_path):
    def always_with_reference(lab, step):
        batch = lab.ref_log_prob(lab.reward(lab.generate(lab.next_prompts())))
        step.record({"custom/ref_mean": float(batch["ref_log_probs"].mean())})
        lab.update_actor(lab.advantages(batch))
        return batch, step.metrics

    register_algorithm("with_ref", always_with_reference, "rloo", reference=True, group_relative=True)
    try:
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=with_ref"))
        assert lab.needs.reference_model and actor_of(lab).reference is not None  # no KL term, yet declared
        assert "custom/ref_mean" in lab.step()
        lab.shutdown()
        with pytest.raises(ConfigError, match=r"batch\.samples_per_prompt: with_ref scores each sample against"):
            Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "b", "algorithm.name=with_ref",
                                                              "batch.samples_per_prompt=1"), start=False)
    finally:
        ALGORITHMS.pop("with_ref")


def test_bad_declarations_fail_at_registration_naming_the_field():
    with pytest.raises(AlgorithmError, match=r"'mine': estimator: 'gea' is not a registered advantage estimator; "
                                             r"register it with @register_advantage_estimator first, or use one of"):
        register_algorithm("mine", grpo, "gea")
    with pytest.raises(AlgorithmError, match=r"'mine': critics: is not something an algorithm declares; declare "
                                             r"critic, reference"):
        register_algorithm("mine", grpo, "grpo", critics=True)
    with pytest.raises(AlgorithmError, match=r"'mine': dataflow: 'grpo' is not a function"):
        register_algorithm("mine", "grpo", "grpo")
    assert "mine" not in ALGORITHMS


def test_a_model_the_config_does_not_provide_fails_before_start(model_dir, tmp_path):
    register_algorithm("rm_grpo", grpo, "grpo", reward_model=True, group_relative=True)
    try:
        with pytest.raises(ConfigError, match=r"reward_model_path: rm_grpo scores with a learned reward model; set "
                                              "reward_model_path to its directory"):
            Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path, "algorithm.name=rm_grpo"),
                start=False)
    finally:
        ALGORITHMS.pop("rm_grpo")
    with pytest.raises(ConfigError, match=r"algorithm\.name: 'nope' is not one of .*register_algorithm"):
        Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path, "algorithm.name=nope"), start=False)


def test_step_seeds_are_per_stage_and_draw_and_cell_by_cell_is_step(model_dir, tmp_path):
    step = StepContext(index=3, run_seed=7)
    seeds = [step.seed("generate"), step.seed("generate"), step.seed("update_actor")]
    assert len(set(seeds)) == 3 and StepContext(3, 7).seed("generate") == seeds[0]
    assert StepContext(4, 7).seed("generate") != seeds[0] != StepContext(3, 8).seed("generate")
    stepped = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "a"))
    stepped.step()
    by_hand = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "b"))
    batch = by_hand.generate(by_hand.next_prompts())
    assert torch.equal(batch["responses"], stepped.last_batch["responses"])  # the same draw, however it is run
    assert by_hand.current_step.metrics["timing_s/generate"] > 0 and by_hand.current_step.index == 0
    stepped.shutdown()
    by_hand.shutdown()


def test_the_overlong_penalty_rewrites_the_scores_the_advantages_see(model_dir, tmp_path):
    """DAPO's length shaping is its own stage: responses in the last ``overlong_buffer`` tokens lose up to
    ``overlong_factor``; the rule's scores go in, the shaped ones come out and are what the update trains on."""
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path, "algorithm.overlong_buffer=4",
                                                           "algorithm.overlong_factor=0.5"))
    scored = lab.reward(lab.generate(lab.next_prompts()))
    shaped = lab.shape_rewards(scored)
    lengths = scored["response_mask"].sum(-1).float()
    expected = scored["scores"] - 0.5 * ((lengths - 1) / 4).clamp(0, 1)  # 5 new tokens, the last 4 penalised
    torch.testing.assert_close(shaped["scores"], expected)
    assert (expected < scored["scores"]).any()
    torch.testing.assert_close(shaped["token_level_scores"].sum(-1), expected)
    assert lab.current_step.metrics["reward/length_penalty"] == pytest.approx((expected - scored["scores"]).mean())
    metrics = lab.step()
    assert metrics["timing_s/shape_rewards"] > 0 and metrics["reward/length_penalty"] < 0
    lab.shutdown()
