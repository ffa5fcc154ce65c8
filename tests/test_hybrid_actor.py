"""The actor on the hybrid engine: TP training with DP on top, generation on the regrouped layout, checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow_lab.config import ConfigError, EngineConfig
from hybridflow_lab.controller import ResourcePool
from hybridflow_lab.dataflows import check_config
from hybridflow_lab.dataflows.preflight import preflight
from hybridflow_lab.hybrid import ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.tensor_parallel import split_dim
from hybridflow_lab.telemetry import Phase
from tests.test_workers import actor_group, lab_config, prompts

MODEL_SIZE, MODEL_SEED = "small", 11  # conftest's model_dir builds this module's model


def tp_config(model_dir: str, t: int, tg: int, strategy: str = "hybridflow", ranks: int = 4):
    config = lab_config(model_dir, engine="torch", ranks=ranks, lr=1e-3)
    actor = dataclasses.replace(config.actor, engine=EngineConfig(backend="torch", tensor_parallel=t))
    return dataclasses.replace(config, actor=actor,
                               rollout=dataclasses.replace(config.rollout, tensor_parallel=tg, reshard=strategy))


def update(actor, rollout, old_log_probs) -> dict[str, float]:
    advantages = torch.linspace(-1.0, 2.0, len(rollout))[:, None] * rollout["response_mask"]
    batch = rollout.union(old_log_probs.select("old_log_probs")).union(
        type(rollout)({"advantages": advantages}))
    return actor.update_actor(batch).meta["metrics"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("t", "tg", "strategy"), [(4, 2, "hybridflow"), (2, 1, "hybridflow")])
def test_tensor_parallel_actor_matches_one_process(ray_cluster, model_dir, t, tg, strategy):
    """Greedy tokens, log-probs and update metrics of the TP actor on 4 ranks equal one process's, over updates;
    every resharding transition is a transfer span carrying the paper's Table 2 bytes."""
    reference = actor_group(lab_config(model_dir, "local", "torch", ranks=1, lr=1e-3), backend="local")
    actor = actor_group(tp_config(model_dir, t, tg, strategy), ResourcePool(4), name=f"tp-actor-{t}-{tg}-{strategy}")
    try:
        for _ in range(3):
            expected, got = (group.generate_sequences(prompts(), greedy=True, n=2) for group in (reference, actor))
            assert torch.equal(got["responses"], expected["responses"])
            torch.testing.assert_close(got["rollout_log_probs"], expected["rollout_log_probs"], rtol=1e-5, atol=1e-5)
            expected_lp, got_lp = reference.compute_log_prob(expected), actor.compute_log_prob(got)
            torch.testing.assert_close(got_lp["old_log_probs"], expected_lp["old_log_probs"], rtol=1e-5, atol=1e-5)
            expected_metrics, got_metrics = update(reference, expected, expected_lp), update(actor, got, got_lp)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                assert got_metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
        spans = [s for s in actor.telemetry.spans(group=actor.name) if s.phase is Phase.TRANSFER]
    finally:
        actor.shutdown()
        reference.shutdown()
    to_generation = [s for s in spans if s.name == "reshard_to_generation"]
    layout, model_bytes = ParallelLayout(t=t, tg=tg, d=4 // t), sharded_bytes(model_dir)
    assert sorted(s.rank for s in to_generation) == sorted([0, 1, 2, 3] * 3)
    assert {s.bytes_moved for s in to_generation} == {formula_bytes_per_rank(strategy, layout, model_bytes)}
    assert {s.attrs["redundant_param_bytes"] for s in to_generation} == {0}
    assert {s.attrs["peak_param_bytes"] for s in to_generation} == {model_bytes // tg}
    assert {s.bytes_moved for s in spans if s.name == "reshard_to_training"} == {0}


def sharded_bytes(model_dir: str) -> int:
    """M: bytes of the tensor-parallel weights (norm weights are replicated and never move)."""
    model = load_causal_lm(model_dir)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if split_dim(n) is not None)


@pytest.mark.ray
@pytest.mark.slow
def test_tensor_parallel_checkpoint_round_trip(ray_cluster, model_dir, tmp_path):
    """A TP-2 x DP-2 actor saves one full HF model directory and each shard's optimizer, and loads them back."""
    actor = actor_group(tp_config(model_dir, 2, 1), ResourcePool(4), name="tp-actor-checkpoint")
    try:
        rollout = actor.generate_sequences(prompts(), greedy=True, n=2)
        update(actor, rollout, actor.compute_log_prob(rollout))
        saved = actor.compute_log_prob(rollout)
        actor.save_checkpoint(str(tmp_path / "ckpt"))
        update(actor, rollout, saved)
        assert not torch.allclose(actor.compute_log_prob(rollout)["old_log_probs"], saved["old_log_probs"])
        actor.load_checkpoint(str(tmp_path / "ckpt"))
        torch.testing.assert_close(actor.compute_log_prob(rollout)["old_log_probs"], saved["old_log_probs"],
                                   rtol=1e-5, atol=1e-5)
        regenerated = actor.generate_sequences(prompts(), greedy=True, n=2)  # generation sees the loaded weights
        torch.testing.assert_close(regenerated["rollout_log_probs"],
                                   actor.compute_log_prob(regenerated)["old_log_probs"], rtol=1e-5, atol=1e-5)
    finally:
        actor.shutdown()
    full = load_causal_lm(tmp_path / "ckpt")  # one full model, loadable without TP
    assert full.lm_head.weight.shape[0] == full.config.vocab_size
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("optimizer*.pt")) == ["optimizer-tp0.pt",
                                                                                "optimizer-tp1.pt"]


@pytest.mark.parametrize(("overrides", "key", "message"), [
    ({"tensor_parallel": 2, "backend": "deepspeed"}, "actor.engine.tensor_parallel", "set actor.engine.backend=torch"),
    ({"tensor_parallel": 3}, "actor.engine.tensor_parallel", "does not divide the 4 ranks"),
])
def test_impossible_tensor_parallel_settings_fail_before_start(model_dir, overrides, key, message):
    config = tp_config(model_dir, 1, 1)
    engine = dataclasses.replace(config.actor.engine, **overrides)
    config = dataclasses.replace(config, actor=dataclasses.replace(config.actor, engine=engine))
    with pytest.raises(ConfigError, match=message) as error:
        check_config(config)
    assert error.value.key == key


def test_generation_tp_must_split_the_model(model_dir):
    with pytest.raises(ConfigError, match=r"size 3 does not divide the model's num_attention_heads \(8\)") as error:
        preflight(tp_config(model_dir, 1, 3), ("actor",))
    assert error.value.key == "rollout.tensor_parallel"


def test_generation_tp_must_divide_training_tp(model_dir):
    with pytest.raises(ConfigError, match=r"generation TP 4 must divide the actor's training TP 2") as error:
        check_config(tp_config(model_dir, 2, 4))
    assert error.value.key == "rollout.tensor_parallel"
