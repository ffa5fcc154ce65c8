"""Capture and replay: a step's batches kept on disk, replayed through other algorithms without touching the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer.capture import read_capture
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.replay import Replayed, ReplayError
from hybridflow_lab.ui import compare
from tests.test_lab import local_overrides

MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it
pytestmark = pytest.mark.xdist_group("replay")  # one run, replayed, for the module's tests


def varied_reward(prompt, response, truth):
    """Scores that differ within a group, so every algorithm has advantages to compare."""
    return float(len(response) % 3) / 2


def rloo_by_hand(scores, uids):
    """Each sample's score minus the mean of the other samples of its prompt."""
    out = torch.empty_like(scores)
    for uid in set(uids.tolist()):
        rows = torch.as_tensor(uids == uid)
        group = scores[rows]
        out[rows] = group - (group.sum() - group) / (len(group) - 1)
    return out


@dataclass
class Replays:
    """A two-step GRPO run that captured ``reward`` and ``adv``, and its step 2 replayed three ways."""

    lab: Lab
    run_dir: Path
    weights: dict[str, torch.Tensor]  # before the replays
    history: list[dict[str, float]]
    stage_spans: int
    grpo: Replayed
    rloo: Replayed
    gspo: Replayed


@pytest.fixture(scope="module")
def replays(model_dir, tmp_path_factory):
    # one optimizer step per batch at a vanishing lr: the probe must then compute what the update computed
    run_dir = tmp_path_factory.mktemp("replay") / "run"
    lab = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, run_dir, "trainer.capture=reward,adv", "trainer.capture_steps=1",
        "batch.update_minibatch_sequences=16", "actor.optim.lr=1e-12"))
    lab.task.reward = varied_reward
    lab.run(2)
    weights = {k: v.clone() for k, v in lab.actor.policy_weights()[0].items()}
    history, stage_spans = list(lab.history), len(lab.telemetry.spans(phase=Phase.STAGE))
    yield Replays(lab, run_dir, weights, history, stage_spans, lab.replay(2, "reward"),
                  lab.replay(2, "reward", "algorithm.name=rloo"),
                  lab.replay(2, "reward", "algorithm.policy_loss=gspo", name="gspo"))
    lab.shutdown()


def test_a_step_captures_the_named_stages_and_keeps_the_newest_steps(replays):
    captures = replays.run_dir / "captures"
    assert sorted(p.name for p in captures.iterdir()) == ["step_000002"]  # capture_steps=1 keeps the newest
    assert sorted(p.name for p in (captures / "step_000002").iterdir()) == [
        "adv.json", "adv.safetensors", "reward.json", "reward.safetensors"]
    captured, record = read_capture(replays.run_dir, 2, "adv")
    assert record["stages"] == ["next_prompts", "generate", "reward", "adv", "update_actor"]
    assert torch.equal(captured["advantages"], replays.lab.last_batch["advantages"])
    reward_capture, _ = read_capture(replays.run_dir, 2, "reward")
    assert "advantages" not in reward_capture and torch.equal(reward_capture["scores"],
                                                              replays.lab.last_batch["scores"])


def test_a_grpo_replay_reuses_the_captured_stages_and_its_probe_computes_what_the_update_did(replays):
    captured, _ = read_capture(replays.run_dir, 2, "adv")
    assert replays.grpo.skipped == ["next_prompts", "generate", "reward"]
    assert torch.equal(replays.grpo.batch["advantages"], captured["advantages"])
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert replays.grpo.metrics[key] == pytest.approx(replays.history[-1][key], rel=1e-4, abs=1e-6), key


def test_an_rloo_replay_gives_each_sample_its_score_minus_the_mean_of_its_groups_others(replays):
    reward_capture, _ = read_capture(replays.run_dir, 2, "reward")
    expected = rloo_by_hand(reward_capture["scores"], reward_capture["uid"])
    mask = replays.rloo.batch["response_mask"].bool()
    assert torch.allclose(replays.rloo.batch["advantages"], expected[:, None].expand_as(mask) * mask, atol=1e-6)


def test_a_gspo_replay_keeps_the_advantages_and_changes_the_gradient_with_its_sequence_level_ratio(replays):
    assert torch.equal(replays.gspo.batch["advantages"], replays.grpo.batch["advantages"])
    assert abs(replays.gspo.metrics["actor/grad_norm"] - replays.grpo.metrics["actor/grad_norm"]) > 1e-6


def test_the_probed_loss_per_token_covers_the_responses_and_is_zero_off_them(replays):
    mask = replays.grpo.batch["response_mask"].bool()
    assert replays.grpo.token_loss.shape == mask.shape and (replays.grpo.token_loss[~mask] == 0).all()
    assert replays.grpo.token_loss[mask].abs().sum() > 0


def test_replays_leave_the_runs_weights_history_and_telemetry_untouched(replays):
    lab = replays.lab
    assert all(torch.equal(replays.weights[k], v) for k, v in lab.actor.policy_weights()[0].items())
    assert lab.history == replays.history and lab.step_index == 2
    assert len(lab.telemetry.spans(phase=Phase.STAGE)) == replays.stage_spans  # the replays' stages kept apart


def test_compare_sets_replays_side_by_side(replays):
    grpo, rloo, gspo = replays.grpo, replays.rloo, replays.gspo
    table = compare(grpo, rloo, gspo).table
    mask = grpo.batch["response_mask"].bool()
    assert list(table.index) == ["grpo", "algorithm.name=rloo", "gspo"]
    assert table.loc["gspo", "grad_norm"] == gspo.metrics["actor/grad_norm"]
    assert table.loc["grpo", "advantage mean"] == pytest.approx(float(grpo.batch["advantages"][mask].mean()))
    assert len(compare(grpo, rloo, gspo).figure.data) == 6  # advantages and loss per replay


def test_a_replay_that_cannot_run_says_why_and_the_run_goes_on(replays):
    lab = replays.lab
    with pytest.raises(FileNotFoundError, match="step 2: adv, reward"):
        lab.replay(1, "reward")
    with pytest.raises(ReplayError, match="needs a critic"):
        lab.replay(2, "reward", "algorithm.name=ppo")
    lab.step()
    assert lab.step_index == 3
