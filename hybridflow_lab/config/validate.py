"""Checks that a configuration can work, run before any worker starts; each error names the key and the fix."""

from __future__ import annotations

import importlib.util

from transformers import PretrainedConfig

from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import LabConfig, RoleConfig
from hybridflow_lab.engines import TRAIN_BACKENDS
from hybridflow_lab.hybrid.layout import STRATEGIES
from hybridflow_lab.models.factory import load_config
from hybridflow_lab.models.tensor_parallel import check_shardable

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
    dp = _data_parallel(name, role)
    if batch.update_minibatch_sequences % dp:
        raise ConfigError(
            "batch.update_minibatch_sequences",
            f"{batch.update_minibatch_sequences} is not divisible by the {dp} data-parallel ranks of the "
            f"{name} ({name}.ranks / {name}.engine.tensor_parallel); use a multiple of {dp}",
        )
    per_rank = batch.update_minibatch_sequences // dp
    if per_rank % batch.micro_batch_sequences_per_rank:
        raise ConfigError(
            "batch.micro_batch_sequences_per_rank",
            f"{batch.micro_batch_sequences_per_rank} does not divide the {per_rank} sequences each {name} rank gets "
            f"per optimizer step (update_minibatch_sequences {batch.update_minibatch_sequences} / {dp} "
            f"data-parallel ranks); use one of {divisors(per_rank)}",
        )
    _model(role.model_path or config.actor.model_path, f"{name}.model_path")


def _data_parallel(name: str, role: RoleConfig) -> int:
    """The role's data-parallel size: its ranks over its training tensor-parallel size."""
    tp = role.engine.tensor_parallel
    if tp < 1:
        raise ConfigError(f"{name}.engine.tensor_parallel", f"must be >= 1, got {tp}")
    if tp > 1 and name != "actor":
        raise ConfigError(f"{name}.engine.tensor_parallel", "only the actor trains tensor-parallel (the hybrid "
                          "engine reshards it for generation); use 1")
    if tp > 1 and role.engine.backend != "torch":
        raise ConfigError(f"{name}.engine.tensor_parallel", f"the {role.engine.backend} engine shards over data "
                          f"parallel instead of tensor parallel; set {name}.engine.backend=torch to train with TP "
                          f"{tp} (DDP over the rest), or {name}.engine.tensor_parallel=1")
    if role.ranks % tp:
        raise ConfigError(f"{name}.engine.tensor_parallel", f"{tp} does not divide the {role.ranks} ranks of the "
                          f"{name} ({name}.ranks); use one of {divisors(role.ranks)}")
    return role.ranks // tp


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
    if rollout.reshard not in STRATEGIES:
        raise ConfigError("rollout.reshard", f"{rollout.reshard!r} is not one of {STRATEGIES}")
    model = _model(config.actor.model_path, "actor.model_path")
    t, tg = config.actor.engine.tensor_parallel, rollout.tensor_parallel
    _check_shardable(model, "actor.engine.tensor_parallel", t)
    _check_shardable(model, "rollout.tensor_parallel", tg)
    if t % tg:
        raise ConfigError("rollout.tensor_parallel", f"generation TP {tg} must divide the actor's training TP {t} "
                          f"(actor.engine.tensor_parallel), so each generation shard is whole training shards; use "
                          f"one of {divisors(t)}, or raise actor.engine.tensor_parallel")
    if rollout.engine == "vllm" and tg > 1:
        raise ConfigError("rollout.tensor_parallel", "vLLM generation sharded over the actor's ranks (vLLM TP = "
                          "rollout.tensor_parallel, each rank feeding its generation shard) is not built yet: it needs "
                          "a GPU to verify; use 1 with vllm (every rank a vLLM replica fed the gathered weights), or "
                          "rollout.engine=torch for tensor-parallel generation")
    if rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm is not installed; install the GPU extra (pip install -e '.[gpu]') "
                          "on a CUDA machine, or use rollout.engine=torch")


def _check_shardable(model: PretrainedConfig, key: str, size: int) -> None:
    try:
        check_shardable(model, size)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _model(path: str, key: str) -> PretrainedConfig:
    if not path:
        raise ConfigError(key, "no model directory given; create one with `hybridflow-lab init-model` or "
                          "hybridflow_lab.models.create_model_dir")
    try:
        return load_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(key, str(exc)) from None
