"""Configs: YAML with dotted overrides, type checks, and bad settings rejected before any worker starts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import hybridflow_lab.config
from hybridflow_lab.config import ConfigError, LabConfig, RolloutConfig, load_config, to_dict, validate
from hybridflow_lab.dataflows.preflight import preflight

MODEL_SEED = 0  # conftest's model_dir: 4 heads, 2 kv heads


def test_yaml_and_overrides(tmp_path, model_dir):
    path = tmp_path / "run.yaml"
    path.write_text(f"actor:\n  model_path: {model_dir}\n  optim:\n    lr: 0.001\nbatch:\n  samples_per_prompt: 8\n")
    config = load_config(LabConfig, path, ["actor.optim.lr=2e-5", "rollout.top_p=0.9", "actor.engine.backend=fsdp"])
    assert config.actor.optim.lr == 2e-5 and config.rollout.top_p == 0.9 and config.batch.samples_per_prompt == 8
    assert config.actor.engine.backend == "fsdp"
    validate(config)
    assert load_config(LabConfig, overrides=[f"{k}={v}" for k, v in [("seed", 3)]]).seed == 3
    assert to_dict(config)["actor"]["optim"]["betas"] == [0.9, 0.999]


BAD = [
    (["actor.optim.lrr=1"], "actor.optim.lrr", "unknown key; valid keys here: betas, eps"),
    (["batch.samples_per_prompt=two"], "batch.samples_per_prompt", "expected int, got 'two'"),
    (["actor.ranks=true"], "actor.ranks", "expected int, got True"),
    (["optim=3"], "optim", "unknown key"),
    (["actor.optim.schedule=cosine"], "actor.optim", "needs optim.total_steps > 0"),
]


@pytest.mark.parametrize(("overrides", "key", "message"), BAD)
def test_bad_keys_and_types_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(LabConfig, overrides=overrides)
    assert info.value.key == key


UNWORKABLE = [
    ({"batch.update_minibatch_sequences": 48}, "batch.update_minibatch_sequences",
     r"48 does not divide the 64 sequences of a step .* use one of \[1, 2, 4, 8, 16, 32, 64\]"),
    ({"actor.ranks": 3, "batch.update_minibatch_sequences": 32}, "batch.update_minibatch_sequences",
     r"32 is not divisible by the 3 data-parallel ranks of the actor \(actor.ranks / actor.engine.tensor_parallel\)"),
    ({"batch.micro_batch_sequences_per_rank": 12}, "batch.micro_batch_sequences_per_rank",
     r"12 does not divide the 32 sequences each actor rank gets per optimizer step"),
    ({"rollout.tensor_parallel": 2}, "rollout.tensor_parallel", r"generation TP 2 must divide the actor's training "
     r"TP 1 \(actor.engine.tensor_parallel\)"),
    ({"actor.engine.tensor_parallel": 2}, "actor.engine.tensor_parallel", "set actor.engine.backend=torch"),
    ({"rollout.reshard": "nccl"}, "rollout.reshard", "'nccl' is not one of"),
    ({"actor.engine.backend": "megatron"}, "actor.engine.backend", "'megatron' is not one of"),
    ({"actor.engine.zero_stage": 4}, "actor.engine.zero_stage", r"4 is not one of \(1, 2, 3\)"),
    ({"backend": "local"}, "actor.ranks", "the local backend runs one rank per role"),
    ({"batch.rollout_batch_prompts": 0}, "batch.rollout_batch_prompts", "must be >= 1"),
    ({"rollout.engine": "sglang"}, "rollout.engine", "'sglang' is not one of"),
    ({"critic.ranks": 1}, "critic.pool", r"critic \(1 ranks\) is colocated with actor \(2 ranks\) on pool 'main'; "
     r".*set critic.ranks=2, or critic.pool=critic"),
    ({"critic.pool": "''"}, "critic.pool", "must name a resource pool"),
    ({"batch.micro_batch_tokens_per_rank": 100, "rollout.max_prompt_tokens": 64, "rollout.max_new_tokens": 64},
     "batch.micro_batch_tokens_per_rank", "100 tokens cannot hold one sequence of up to 128 .* use at least 128"),
    ({"batch.micro_batch_tokens_per_rank": -1}, "batch.micro_batch_tokens_per_rank", "must be >= 0"),
]


@pytest.mark.parametrize(("settings", "key", "message"), UNWORKABLE)
def test_unworkable_settings_fail_before_any_worker_starts(model_dir, settings, key, message):
    overrides = [f"actor.model_path={model_dir}"] + [f"{k}={v}" for k, v in settings.items()]
    config = load_config(LabConfig, overrides=overrides)
    with pytest.raises(ConfigError, match=message) as info:
        validate(config)
    assert info.value.key == key


UNAVAILABLE = [  # settings whose rules hold, which the model files cannot serve
    ({"rollout.tensor_parallel": 3, "rollout.engine": "vllm"}, "rollout.tensor_parallel",
     r"size 3 does not divide the model's num_attention_heads \(4\); use one of \[1, 2\]"),
    ({"actor.model_path": "/nonexistent/model"}, "actor.model_path", "does not exist"),
    ({"critic.model_path": "/nonexistent/critic"}, "critic.model_path", "does not exist"),
]


@pytest.mark.parametrize(("settings", "key", "message"), UNAVAILABLE)
def test_model_files_that_cannot_serve_the_settings_fail_the_preflight(model_dir, settings, key, message):
    overrides = [f"actor.model_path={model_dir}"] + [f"{k}={v}" for k, v in settings.items()]
    with pytest.raises(ConfigError, match=message) as info:
        preflight(load_config(LabConfig, overrides=overrides), ("actor", "critic"))
    assert info.value.key == key


def test_the_rules_read_no_file(tmp_path):
    validate(load_config(LabConfig, overrides=[f"actor.model_path={tmp_path / 'nothing_here'}"]))


RULE_MODULES = ("loading", "bounds", "batch_sizes", "rules", "presets")


@pytest.mark.parametrize("module", RULE_MODULES)
def test_the_rules_import_neither_torch_nor_model_code(module):
    source = Path(hybridflow_lab.config.__file__).with_name(f"{module}.py")
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    allowed = {name for name in imported if name.split(".")[0] in sys.stdlib_module_names | {"yaml"}}
    assert {name for name in imported - allowed if not name.startswith("hybridflow_lab.config.")} == set()


TWO_CONFLICTS = [  # a minibatch that does not divide the step, and a micro-batch that does not divide a rank's share
    ("batch.update_minibatch_sequences=48", "batch.micro_batch_sequences_per_rank=5"),  # 48 / 64; 5 / 24
    ("batch.samples_per_prompt=3", "batch.micro_batch_sequences_per_rank=12"),  # 64 / 48; 12 / 32
    ("actor.ranks=4", "critic.ranks=4", "batch.update_minibatch_sequences=48", "batch.rollout_batch_prompts=8",
     "batch.micro_batch_sequences_per_rank=8"),  # 48 / 32; 8 / 12
]


@pytest.mark.parametrize("overrides", TWO_CONFLICTS)
def test_batch_size_conflicts_are_named_together_with_values_that_resolve_them_all(overrides):
    with pytest.raises(ConfigError) as info:
        validate(load_config(LabConfig, overrides=overrides), roles=("actor",))
    first, *conflicts, proposal = str(info.value).splitlines()
    assert first == "batch.update_minibatch_sequences: 2 batch-size conflicts:"
    assert [line.split(":")[0].strip() for line in conflicts] == ["batch.update_minibatch_sequences",
                                                                 "batch.micro_batch_sequences_per_rank"]
    values = proposal.removeprefix("set together, so that every batch-size rule holds: ").split()
    validate(load_config(LabConfig, overrides=[*overrides, *values]), roles=("actor",))


def test_the_proposed_batch_sizes_stay_as_close_as_the_rules_allow():
    with pytest.raises(ConfigError) as info:
        validate(load_config(LabConfig, overrides=["batch.update_minibatch_sequences=48",
                                                   "batch.micro_batch_sequences_per_rank=5"]))
    assert str(info.value).endswith("batch.update_minibatch_sequences=32 batch.micro_batch_sequences_per_rank=4")


def test_ranks_that_cannot_share_a_step_raise_the_prompts_per_step():
    with pytest.raises(ConfigError) as info:
        validate(load_config(LabConfig, overrides=["actor.ranks=3", "critic.ranks=3"]))
    assert str(info.value).endswith("batch.rollout_batch_prompts=18 batch.update_minibatch_sequences=36 "
                                    "batch.micro_batch_sequences_per_rank=6")  # 72 sequences, 12 per rank


def test_a_yaml_key_given_twice_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  top_p: 0.9\n  temperature: 0.7\n  top_p: 0.5\n")
    with pytest.raises(ConfigError, match=r"line 4: key 'top_p' is given twice in one section \(first on line 2\)"):
        load_config(LabConfig, path)


def test_a_lora_rank_of_zero_is_refused_and_leaving_it_unset_is_full_fine_tuning():
    with pytest.raises(ConfigError, match="0 trains no adapters") as info:
        load_config(LabConfig, overrides=["actor.lora.rank=0"])
    assert info.value.key == "actor.lora.rank"
    assert not load_config(LabConfig).actor.lora.enabled


@pytest.mark.parametrize(("old", "new"), [("torch_compile", "compiled"), ("onednn_decode", "onednn")])
def test_the_old_decoding_switches_are_refused_naming_the_setting_that_replaced_them(old, new):
    with pytest.raises(ConfigError, match=f"set rollout.decoding={new}") as info:
        load_config(LabConfig, overrides=[f"rollout.{old}=false"])
    assert info.value.key == f"rollout.{old}"


def test_a_choice_outside_its_literal_is_refused_for_a_config_built_in_python():
    with pytest.raises(ConfigError, match=r"'onnx' is not one of \('eager', 'compiled', 'onednn'\)") as info:
        validate(LabConfig(rollout=RolloutConfig(decoding="onnx")))  # type: ignore[arg-type]
    assert info.value.key == "rollout.decoding"


def test_verl_kl_names_are_read_as_the_projects_and_the_aggregation_follows_the_algorithm():
    config = load_config(LabConfig, overrides=["algorithm.kl_loss_kind=low_var_kl", "algorithm.kl_reward_kind=kl"])
    assert (config.algorithm.kl_loss_kind, config.algorithm.kl_reward_kind) == ("k3", "k1")
    assert to_dict(config)["algorithm"]["kl_loss_kind"] == "k3"


def test_the_config_and_the_kl_estimators_read_verls_kl_names_alike():
    """The configuration (which imports no algorithm code) keeps its own copy of verl's KL names."""
    from hybridflow_lab.algorithms import kl
    from hybridflow_lab.config import schema

    assert schema.KL_ALIASES == kl.KL_ALIASES
    aggregation = {(name, loss): load_config(LabConfig, overrides=[f"algorithm.name={name}",
                                                                   f"algorithm.policy_loss={loss}"]).algorithm.aggregation
                   for name, loss in (("grpo", "ppo"), ("dr_grpo", "ppo"), ("grpo", "gspo"), ("ppo", "cispo"))}
    assert aggregation == {("grpo", "ppo"): "token-mean", ("dr_grpo", "ppo"): "seq-mean-token-sum-norm",
                           ("grpo", "gspo"): "seq-mean-token-mean", ("ppo", "cispo"): "token-mean"}
    explicit = load_config(LabConfig, overrides=["algorithm.name=dr_grpo", "algorithm.loss_agg=token-mean"])
    assert explicit.algorithm.aggregation == "token-mean"


def test_every_policy_loss_keyword_is_an_algorithm_setting():
    from dataclasses import fields

    from hybridflow_lab.algorithms.registry import POLICY_LOSS_KEYWORDS
    from hybridflow_lab.config import AlgorithmConfig

    assert set(POLICY_LOSS_KEYWORDS) <= {f.name for f in fields(AlgorithmConfig)}


def test_every_preset_is_a_config_that_works(model_dir):
    from hybridflow_lab.config.presets import presets, resolve_config
    from hybridflow_lab.dataflows import check_config

    assert {"arithmetic_grpo", "countdown_grpo", "sorting_grpo"} <= set(presets())
    for name in presets():
        check_config(resolve_config(name, [f"actor.model_path={model_dir}"]))
