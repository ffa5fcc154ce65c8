"""Capture and replay: a step's batches kept on disk, replayed through other algorithms without touching the run."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.models import create_model_dir
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer.capture import read_capture
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.replay import ReplayError
from hybridflow_lab.ui import compare
from tests.test_lab import local_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_model_dir(tmp_path_factory.mktemp("replay") / "m", "tiny", "qwen2", seed=3))


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


def test_a_captured_batch_replays_through_grpo_rloo_and_gspo_and_the_run_is_untouched(model_dir, tmp_path):
    # one optimizer step per batch at a vanishing lr: the probe must then compute what the update computed
    lab = Lab("arithmetic_grpo", overrides=local_overrides(
        model_dir, tmp_path / "run", "trainer.capture=reward,adv", "trainer.capture_steps=1",
        "batch.update_minibatch_sequences=16", "actor.optim.lr=1e-12"))
    lab.task.reward = varied_reward
    lab.run(2)
    captures = tmp_path / "run" / "captures"
    assert sorted(p.name for p in captures.iterdir()) == ["step_000002"]  # capture_steps=1 keeps the newest
    assert sorted(p.name for p in (captures / "step_000002").iterdir()) == [
        "adv.json", "adv.safetensors", "reward.json", "reward.safetensors"]
    captured, record = read_capture(tmp_path / "run", 2, "adv")
    assert record["stages"] == ["next_prompts", "generate", "reward", "adv", "update_actor"]
    assert torch.equal(captured["advantages"], lab.last_batch["advantages"])
    assert captured["uid"].tolist() == lab.last_batch["uid"].tolist()
    reward_capture, _ = read_capture(tmp_path / "run", 2, "reward")
    assert "advantages" not in reward_capture and torch.equal(reward_capture["scores"], lab.last_batch["scores"])

    weights = {k: v.clone() for k, v in lab.actor.policy_weights()[0].items()}
    history, stages = list(lab.history), len(lab.telemetry.spans(phase=Phase.STAGE))

    grpo = lab.replay(2, "reward")
    assert grpo.skipped == ["next_prompts", "generate", "reward"]
    assert torch.equal(grpo.batch["advantages"], captured["advantages"])
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert grpo.metrics[key] == pytest.approx(history[-1][key], rel=1e-4, abs=1e-6), key
    rloo = lab.replay(2, "reward", "algorithm.name=rloo")
    expected = rloo_by_hand(reward_capture["scores"], reward_capture["uid"])
    mask = rloo.batch["response_mask"].bool()
    assert torch.allclose(rloo.batch["advantages"], expected[:, None].expand_as(mask) * mask, atol=1e-6)
    gspo = lab.replay(2, "reward", "algorithm.policy_loss=gspo", name="gspo")
    assert torch.equal(gspo.batch["advantages"], grpo.batch["advantages"])
    assert abs(gspo.metrics["actor/grad_norm"] - grpo.metrics["actor/grad_norm"]) > 1e-6  # a sequence-level ratio
    assert grpo.token_loss.shape == mask.shape and (grpo.token_loss[~mask] == 0).all()
    assert grpo.token_loss[mask].abs().sum() > 0

    assert all(torch.equal(weights[k], v) for k, v in lab.actor.policy_weights()[0].items())
    assert lab.history == history and lab.step_index == 2
    assert len(lab.telemetry.spans(phase=Phase.STAGE)) == stages  # the replays' stages are kept apart

    table = compare(grpo, rloo, gspo).table
    assert list(table.index) == ["grpo", "algorithm.name=rloo", "gspo"]
    assert table.loc["gspo", "grad_norm"] == gspo.metrics["actor/grad_norm"]
    assert table.loc["grpo", "advantage mean"] == pytest.approx(float(grpo.batch["advantages"][mask].mean()))
    assert len(compare(grpo, rloo, gspo).figure.data) == 6  # advantages and loss per replay

    with pytest.raises(FileNotFoundError, match="step 2: adv, reward"):
        lab.replay(1, "reward")
    with pytest.raises(ReplayError, match="needs a critic"):
        lab.replay(2, "reward", "algorithm.name=ppo")
    lab.step()  # the run goes on from where it was
    assert lab.step_index == 3
    lab.shutdown()
