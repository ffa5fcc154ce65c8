"""LoRA adapters and gradient checkpointing: equal maths, a free reference, adapter checkpoints that resume."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow_lab.config import ConfigError, OptimConfig
from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_nll
from hybridflow_lab.hybrid.engine import state_dict_sink
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.decoder import enable_gradient_checkpointing
from hybridflow_lab.models.lora import (
    ADAPTER_WEIGHTS,
    LoraConfig,
    adapter_settings,
    adapters_disabled,
    apply_lora,
    load_adapters,
    merged_weights,
    save_adapters,
)
from hybridflow_lab.trainer.lab import Lab
from tests.engine_workers import EngineProbe
from tests.test_engines import sequences
from tests.test_lab import local_overrides

MODEL_SEED = 5  # conftest's model_dir builds this module's tiny model with it


def adapted(model_dir, rank=4, seed=0, **settings):
    """The tiny model with adapters whose ``lora_B`` is random (a fresh adapter is zero: the base)."""
    torch.manual_seed(seed)
    model = apply_lora(load_causal_lm(model_dir), LoraConfig(rank=rank, alpha=8, **settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.05)
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


IDS = torch.randint(4, 90, (3, 12), generator=torch.Generator().manual_seed(0))


def test_lora_logits_equal_the_merged_models(model_dir):
    model = adapted(model_dir)
    merged = load_causal_lm(model_dir)
    stats = state_dict_sink(merged)(merged_weights(model.state_dict().items(), model))
    assert stats["tensors"] == len(merged.state_dict())  # every plain tensor arrived, no adapter tensor did
    base = logits(load_causal_lm(model_dir), IDS)
    ours = logits(model, IDS)
    assert (ours - base).abs().max() > 1e-2  # the adapters do change the model
    torch.testing.assert_close(logits(merged.eval(), IDS), ours, rtol=0, atol=2e-5)


def test_with_adapters_off_the_model_is_its_base_exactly(model_dir):
    model = adapted(model_dir)
    with adapters_disabled(model):
        assert torch.equal(logits(model, IDS), logits(load_causal_lm(model_dir), IDS))
    assert not torch.equal(logits(model, IDS), logits(load_causal_lm(model_dir), IDS))  # switched back on


def test_a_fresh_adapter_starts_as_the_base_and_only_adapters_train(model_dir):
    base = load_causal_lm(model_dir)
    model = apply_lora(load_causal_lm(model_dir), LoraConfig(rank=4))
    assert torch.equal(logits(model.eval(), IDS), logits(base, IDS))
    engine = build_train_engine("torch", model, OptimConfig(lr=1e-2))
    trained = {name for group in engine.optimizer.param_groups for name, p in model.named_parameters()
               if any(p is q for q in group["params"])}
    assert trained and all(name.endswith(("lora_A", "lora_B")) for name in trained)
    before = {name: p.clone() for name, p in model.named_parameters()}
    engine.train_step(sequences().chunk(2), response_nll, count_response_tokens)
    for name, parameter in model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        assert changed == name.endswith(("lora_A", "lora_B")) or name.endswith("lora_A"), name  # B moves first


@pytest.mark.parametrize(("arch", "targets"), [("qwen2", ("q_proj", "v_proj", "down_proj")),
                                               ("phi3", ("qkv_proj", "gate_up_proj"))])
def test_saved_adapters_load_in_peft_with_the_same_logits(tiny_models, tmp_path, arch, targets):
    """The project's decoder (Qwen2) and the transformers path (Phi-3's fused projections) save PEFT's format."""
    path = tiny_models(MODEL_SEED, arch=arch)
    model = adapted(path, target_modules=targets)
    save_adapters(model, tmp_path / "a")
    base = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "a").eval()
    torch.testing.assert_close(logits(theirs, IDS).logits, logits(model, IDS), rtol=0, atol=1e-5)


def test_adapters_peft_wrote_load_into_the_project_model_and_other_settings_are_refused(model_dir, tmp_path):
    settings = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True), settings)
    theirs.save_pretrained(tmp_path / "a")
    ours = apply_lora(load_causal_lm(model_dir), adapter_settings(tmp_path / "a"))
    load_adapters(ours, tmp_path / "a")
    torch.testing.assert_close(logits(ours.eval(), IDS), logits(theirs.eval(), IDS).logits, rtol=0, atol=1e-5)
    smaller = apply_lora(load_causal_lm(model_dir), LoraConfig(rank=4, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match=r"do not match the model's: missing .*unexpected"):
        load_adapters(smaller, tmp_path / "a")


def test_gradient_checkpointing_gives_the_same_gradients(model_dir):
    def gradients(checkpointed: bool):
        model = load_causal_lm(model_dir).train()
        if checkpointed:
            enable_gradient_checkpointing(model)
        loss, _ = response_nll(model, sequences())
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def lora_lab(model_dir, run_dir, *extra, resume=False):
    return Lab("arithmetic_grpo", overrides=local_overrides(model_dir, run_dir, "actor.lora.rank=8",
                                                          "actor.lora.alpha=16", "algorithm.kl_loss_coef=0.1",
                                                          *extra), resume=resume)


SIGNS = torch.tensor([1.0, -1.0])  # advantages for a random policy, which scores 0 on every row


def local_actor(lab):
    """The actor object of a local-backend Lab (it lives in this process)."""
    (actor,) = lab.actor._backend.hosts[0].roles.values()
    return actor


def test_the_lora_reference_is_the_base_and_costs_no_parameter_memory(model_dir, tmp_path):
    lab = lora_lab(model_dir, tmp_path / "run")
    try:
        actor = local_actor(lab)
        assert actor.reference is None  # no second model: the reference is the actor with its adapters off
        base = sum(p.numel() for p in load_causal_lm(model_dir).parameters())
        adapters = sum(p.numel() for p in actor.engine.model.parameters() if p.requires_grad)
        assert sum(p.numel() for p in actor.engine.model.parameters()) == base + adapters
        batch = lab.reward(lab.generate(lab.next_prompts()))
        batch = lab.ref_log_prob(lab.old_log_prob(batch))
        torch.testing.assert_close(batch["ref_log_probs"], batch["old_log_probs"], rtol=0, atol=1e-6)  # B is zero
        batch["advantages"] = SIGNS.repeat(len(batch) // 2)[:, None] * batch["response_mask"]  # non-zero gradient
        lab.update_actor(batch)
        fresh = batch.select(*(set(batch.keys()) - {"old_log_probs", "entropy", "ref_log_probs"}))
        moved = lab.ref_log_prob(lab.old_log_prob(fresh))
        assert (moved["old_log_probs"] - moved["ref_log_probs"]).abs().max() > 1e-4  # the policy moved away
        torch.testing.assert_close(moved["ref_log_probs"], batch["ref_log_probs"], rtol=0, atol=1e-6)  # the base not
    finally:
        lab.shutdown()


def test_the_built_in_rollout_generates_with_the_merged_weights(model_dir, tmp_path):
    lab = lora_lab(model_dir, tmp_path / "run", "actor.optim.lr=5e-2")
    try:
        batch = lab.ref_log_prob(lab.reward(lab.generate(lab.next_prompts())))
        batch["advantages"] = SIGNS.repeat(len(batch) // 2)[:, None] * batch["response_mask"]
        lab.update_actor(batch)
        lab.generate(lab.next_prompts())  # syncs the generation copy
        actor = local_actor(lab)
        copy, trained = actor.hybrid.model, actor.engine.model
        assert copy is not trained and not any(name.endswith("lora_A") for name in copy.state_dict())
        torch.testing.assert_close(logits(copy.eval(), IDS), logits(trained.eval(), IDS), rtol=0, atol=2e-5)
        assert any(s.name == "weight_sync" for s in lab.telemetry.spans())
    finally:
        lab.shutdown()


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_to_the_same_next_step(model_dir, tmp_path):
    straight = lora_lab(model_dir, tmp_path / "a")
    straight.run(2)
    checkpoint = straight.save()
    expected = straight.step()
    straight.shutdown()
    files = {p.name for p in checkpoint.rglob("*") if p.is_file()}
    assert ADAPTER_WEIGHTS in files and "model.safetensors" not in files  # the frozen base is not copied
    resumed = lora_lab(model_dir, tmp_path / "a", resume=True)
    assert resumed.step_index == 2
    again = resumed.step()
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert again[key] == pytest.approx(expected[key], rel=1e-6), key
    resumed.shutdown()


def local_critic(lab):
    (critic,) = lab.critic._backend.hosts[0].roles.values()
    return critic


def test_a_lora_critic_trains_its_adapters_and_value_head_only_and_resumes_from_them(model_dir, tmp_path):
    def ppo_lab(resume=False):
        return Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=ppo",
                                                                "critic.lora.rank=8", "critic.lora.alpha=16"),
                   resume=resume)

    lab = ppo_lab()
    try:
        critic = local_critic(lab).engine.model
        base = {name: p.detach().clone() for name, p in critic.named_parameters() if not p.requires_grad}
        assert {n for n, p in critic.named_parameters() if p.requires_grad} == \
            {n for n in critic.state_dict() if n.endswith(("lora_A", "lora_B"))} | {"score.weight"}
        batch = lab.reward(lab.generate(lab.next_prompts()))
        batch["returns"] = 0.5 * batch["response_mask"]  # a target to fit (a random policy's returns are all zero)
        losses = []
        for _ in range(4):
            batch = lab.values(batch.select(*(set(batch.keys()) - {"values"})))
            losses.append(lab.update_critic(batch)["critic/vf_loss"])
        assert losses[-1] < 0.8 * losses[0], losses
        for name, parameter in critic.named_parameters():
            if name in base:
                assert torch.equal(parameter, base[name]), name  # the frozen backbone did not move
        assert any(p.abs().max() > 0 for n, p in critic.named_parameters() if n.endswith("lora_B"))  # adapters did
        expected = lab.values(batch.select(*(set(batch.keys()) - {"values"})))["values"]
        checkpoint = lab.save()
    finally:
        lab.shutdown()
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert f"critic/{ADAPTER_WEIGHTS}" in files and "critic/model.safetensors" not in files, files
    resumed = ppo_lab(resume=True)
    try:
        again = resumed.values(batch.select(*(set(batch.keys()) - {"values"})))["values"]
        torch.testing.assert_close(again, expected, rtol=0, atol=0)
    finally:
        resumed.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "stage"), [("deepspeed", 3), ("fsdp", 0)], ids=["deepspeed3", "fsdp"])
# the torch engine: the Lab tests above; ZeRO-1/2 save and load through the same DeepSpeed calls as ZeRO-3
def test_every_engine_trains_only_the_adapters_and_resumes_from_them(ray_cluster, model_dir, tmp_path, backend,
                                                                     stage):
    def build():
        return WorkerGroup(Role(EngineProbe, model_dir, backend, zero_stage=stage, lora_rank=4), ResourcePool(2),
                           name=f"lora-{backend}{stage}")

    base = load_causal_lm(model_dir).state_dict()
    group = build()
    group.train(sequences(), steps=2)
    weights = group.weights()[0]
    for name, value in base.items():
        assert torch.equal(weights[name], value), name  # the frozen base did not move
    assert any(weights[n].abs().max() > 0 for n in weights if n.endswith("lora_B"))
    group.save_checkpoint(str(tmp_path / "ckpt"))
    expected = group.train(sequences(seed=1), steps=2).meta["losses"]
    group.shutdown()
    saved = sum(p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert saved < base_bytes / 2, saved  # adapters and their optimizer state, not the base
    resumed = build()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.train(sequences(seed=1), steps=2).meta["losses"] == pytest.approx(expected, rel=1e-6)
    resumed.shutdown()


def test_lora_on_tensor_parallel_shards_is_refused_before_start(model_dir, tmp_path):
    overrides = [o for o in local_overrides(model_dir, tmp_path, "actor.lora.rank=8") if "backend=local" not in o]
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank: LoRA adapters are not built for tensor-parallel"):
        Lab("arithmetic_grpo", overrides=(*overrides, "actor.ranks=2", "actor.engine.tensor_parallel=2"),
            start=False)
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules: .* has no linear layer named lm_head"):
        Lab("arithmetic_grpo", overrides=(*local_overrides(model_dir, tmp_path, "actor.lora.rank=8"),
                                          "actor.lora.target_modules=[lm_head]"), start=False)
