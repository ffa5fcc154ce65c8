"""Checks that a configuration can work, run before any worker starts; each error names the key and the fix."""

from __future__ import annotations

import importlib.util

from transformers import PretrainedConfig

from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import LabConfig, RoleConfig
from hybridflow_lab.engines import TRAIN_BACKENDS
from hybridflow_lab.models.factory import load_config

ROLLOUT_ENGINES = ("torch", "vllm")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(config: LabConfig, roles: tuple[str, ...] = ("actor", "critic")) -> None:
    """Raise ``ConfigError`` for the first setting that cannot work with the others."""
    if config.backend not in ("ray", "local"):
        raise ConfigError("backend", f"must be 'ray' or 'local', got {config.backend!r}")
    _check_batch(config)
    for name in roles:
        _check_role(config, name, getattr(config, name))
    _check_pools(config, roles)
    _check_rollout(config)
    if config.reward_model_path:
        _model(config.reward_model_path, "reward_model_path")


def _check_batch(config: LabConfig) -> None:
    batch = config.batch
    for key in ("rollout_batch_prompts", "samples_per_prompt", "update_minibatch_sequences",
                "micro_batch_sequences_per_rank", "update_epochs"):
        if getattr(batch, key) < 1:
            raise ConfigError(f"batch.{key}", f"must be >= 1, got {getattr(batch, key)}")
    step = batch.step_sequences
    if step % batch.update_minibatch_sequences:
        raise ConfigError(
            "batch.update_minibatch_sequences",
            f"{batch.update_minibatch_sequences} does not divide the {step} sequences of a step (rollout_batch_prompts "
            f"{batch.rollout_batch_prompts} x samples_per_prompt {batch.samples_per_prompt}); use one of "
            f"{divisors(step)}",
        )


def _check_role(config: LabConfig, name: str, role: RoleConfig) -> None:
    batch = config.batch
    if role.ranks < 1:
        raise ConfigError(f"{name}.ranks", f"must be >= 1, got {role.ranks}")
    if config.backend == "local" and role.ranks != 1:
        raise ConfigError(f"{name}.ranks", "the local backend runs one rank per role; set it to 1 or use backend=ray")
    if role.engine.backend not in TRAIN_BACKENDS:
        raise ConfigError(f"{name}.engine.backend", f"{role.engine.backend!r} is not one of {TRAIN_BACKENDS}")
    if role.engine.zero_stage not in (1, 2, 3):
        raise ConfigError(f"{name}.engine.zero_stage", f"must be 1, 2 or 3, got {role.engine.zero_stage}")
    if batch.update_minibatch_sequences % role.ranks:
        raise ConfigError(
            "batch.update_minibatch_sequences",
            f"{batch.update_minibatch_sequences} is not divisible by the {role.ranks} data-parallel ranks of the "
            f"{name} ({name}.ranks); use a multiple of {role.ranks}",
        )
    per_rank = batch.update_minibatch_sequences // role.ranks
    if per_rank % batch.micro_batch_sequences_per_rank:
        raise ConfigError(
            "batch.micro_batch_sequences_per_rank",
            f"{batch.micro_batch_sequences_per_rank} does not divide the {per_rank} sequences each {name} rank gets "
            f"per optimizer step (update_minibatch_sequences {batch.update_minibatch_sequences} / {role.ranks} "
            f"ranks); use one of {divisors(per_rank)}",
        )
    _model(role.model_path or config.actor.model_path, f"{name}.model_path")


def _check_pools(config: LabConfig, roles: tuple[str, ...]) -> None:
    """Roles sharing a pool are colocated rank by rank, so they need the same number of ranks."""
    first_on_pool: dict[str, str] = {}
    for name in roles:
        role: RoleConfig = getattr(config, name)
        if not role.pool:
            raise ConfigError(f"{name}.pool", "must name a resource pool (e.g. 'main')")
        other = first_on_pool.setdefault(role.pool, name)
        other_ranks = getattr(config, other).ranks
        if role.ranks != other_ranks:
            raise ConfigError(
                f"{name}.pool", f"{name} ({role.ranks} ranks) is colocated with {other} ({other_ranks} ranks) on pool "
                f"{role.pool!r}; colocated roles need the same ranks: set {name}.ranks={other_ranks}, or "
                f"{name}.pool={name} to give it its own devices",
            )


def _check_rollout(config: LabConfig) -> None:
    rollout = config.rollout
    if rollout.engine not in ROLLOUT_ENGINES:
        raise ConfigError("rollout.engine", f"{rollout.engine!r} is not one of {ROLLOUT_ENGINES}")
    for key in ("max_prompt_tokens", "max_new_tokens", "tensor_parallel"):
        if getattr(rollout, key) < 1:
            raise ConfigError(f"rollout.{key}", f"must be >= 1, got {getattr(rollout, key)}")
    tp = rollout.tensor_parallel
    model = _model(config.actor.model_path, "actor.model_path")
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads % tp or kv_heads % tp:
        usable = [d for d in divisors(kv_heads) if heads % d == 0]
        raise ConfigError("rollout.tensor_parallel", f"{tp} does not divide the model's {heads} attention heads and "
                          f"{kv_heads} key/value heads; use one of {usable}")
    if config.actor.ranks % tp:
        raise ConfigError("rollout.tensor_parallel", f"{tp} does not divide the actor's {config.actor.ranks} ranks "
                          f"(actor.ranks); use one of {divisors(config.actor.ranks)}")
    if rollout.engine == "vllm" and tp > 1:
        raise ConfigError("rollout.tensor_parallel", "vLLM runs inside each actor rank with tensor_parallel=1 "
                          "(tensor-parallel vLLM across ranks comes with the hybrid engine); use 1")
    if rollout.engine == "torch" and tp > 1:
        raise ConfigError("rollout.tensor_parallel", "the built-in torch engine generates with tensor_parallel=1 "
                          "(tensor-parallel generation comes with the hybrid engine); use 1, or rollout.engine=vllm")
    if rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm is not installed; install the GPU extra (pip install -e '.[gpu]') "
                          "on a CUDA machine, or use rollout.engine=torch")


def _model(path: str, key: str) -> PretrainedConfig:
    if not path:
        raise ConfigError(key, "no model directory given; create one with `hybridflow-lab init-model` or "
                          "hybridflow_lab.models.create_model_dir")
    try:
        return load_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(key, str(exc)) from None
