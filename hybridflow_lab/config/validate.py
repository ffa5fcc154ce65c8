"""Checks that a configuration can work, run before any worker starts; each error names the key and the fix."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable
from functools import reduce
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PretrainedConfig

from hybridflow_lab.algorithms.rollout_correction import LEVELS as ROLLOUT_CORRECTION_LEVELS
from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import (
    RESHARD_STRATEGIES,
    TRAIN_BACKENDS,
    EngineConfig,
    LabConfig,
    RoleConfig,
    RolloutConfig,
)
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.factory import load_config
from hybridflow_lab.models.heads import has_trained_head, untrained_head_message
from hybridflow_lab.models.onednn_decode import missing_onednn
from hybridflow_lab.models.tensor_parallel import check_shardable
from hybridflow_lab.models.tokenizers import load_tokenizer

DEVICES = ("auto", "cpu", "cuda")
ROLLOUT_ENGINES = ("torch", "vllm")
VLLM_DTYPES = ("", "float32", "bfloat16", "float16")
KV_CACHE_SHARE = 0.5  # of the free RAM, for all of a machine's vLLM KV caches: weights and training need the rest
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Bound(NamedTuple):
    """A setting's allowed values: its dotted key, the rule in words, the test, and what to set instead."""

    key: str
    rule: str
    holds: Callable[[Any], bool]
    fix: str


def _at_least(n: int) -> Callable[[Any], bool]:
    return lambda value: value >= n


def _positive(value: float) -> bool:
    return value > 0


def _fraction(value: float) -> bool:
    return 0 < value <= 1


def _probability(value: float) -> bool:
    return 0 <= value <= 1


WHOLE_NUMBER = "use a whole number >= 1"
BOUNDS = (
    *(Bound(f"batch.{key}", ">= 1", _at_least(1), WHOLE_NUMBER)
      for key in ("rollout_batch_prompts", "samples_per_prompt", "update_minibatch_sequences",
                  "micro_batch_sequences_per_rank", "update_epochs")),
    *(Bound(f"rollout.{key}", ">= 1", _at_least(1), WHOLE_NUMBER)
      for key in ("max_prompt_tokens", "max_new_tokens", "tensor_parallel", "kv_cache_gib")),
    Bound("batch.micro_batch_tokens_per_rank", ">= 0", _at_least(0), "use 0 to size micro-batches by sequences, "
          "or a token count that holds a few sequences"),
    Bound("rollout.temperature", "> 0", _positive, "sampling divides the logits by it; use 1.0 (greedy decoding "
          "is lab.generate(prompts, greedy=True))"),
    Bound("rollout.top_p", "in (0, 1]", _fraction, "use 1.0 to turn nucleus sampling off"),
    Bound("rollout.top_k", ">= 0", _at_least(0), "use 0 to turn top-k sampling off"),
    Bound("rollout.gpu_memory_utilization", "in (0, 1]", _fraction, "it is vLLM's share of GPU memory; use e.g. "
          "0.5"),
    Bound("algorithm.clip_low", "in (0, 1)", lambda v: 0 < v < 1, "the ratio is clipped to [1 - clip_low, "
          "1 + clip_high]; use e.g. 0.2"),
    Bound("algorithm.clip_high", "> 0", _positive, "use e.g. 0.2, or 0.28 for DAPO's clip-higher"),
    Bound("algorithm.dual_clip", "0 (off) or > 1", lambda v: v == 0 or v > 1, "use e.g. 3.0, or 0 to turn dual "
          "clip off"),
    Bound("algorithm.gamma", "in [0, 1]", _probability, "use 1.0 (no discount)"),
    Bound("algorithm.lam", "in [0, 1]", _probability, "use 1.0, or e.g. 0.95 for GAE"),
    Bound("algorithm.kl_loss_coef", ">= 0", _at_least(0), "use 0 for no KL loss term (e.g. 0.001 for one)"),
    Bound("algorithm.kl_reward_coef", ">= 0", _at_least(0), "use 0 for no KL penalty in the rewards (e.g. 0.05 "
          "for one)"),
    Bound("algorithm.kl_target", ">= 0", _at_least(0), "use 0 for a fixed KL coefficient"),
    Bound("algorithm.gspo_clip_low", "in (0, 1)", lambda v: 0 < v < 1, "GSPO's sequence ratio is clipped to "
          "[1 - low, 1 + high]; use the paper's 3e-4"),
    Bound("algorithm.gspo_clip_high", "> 0", _positive, "use the paper's 4e-4"),
    Bound("algorithm.cispo_clip_low", "in [0, 1]", _probability, "CISPO's weights are clipped to [1 - low, "
          "1 + high]; use 1.0 for no lower bound"),
    Bound("algorithm.cispo_clip_high", "> 0", _positive, "use 4.0 (weights capped at 5, ScaleRL's choice)"),
    Bound("algorithm.rollout_is", "'auto', '', 'token' or 'sequence'", lambda v: v == "auto" or v in
          ROLLOUT_CORRECTION_LEVELS, "'' turns truncated importance sampling off; 'token' (TIS) weights each token "
          "by min(pi_train / pi_rollout, rollout_is_cap); 'auto' is 'token' when generation runs ahead "
          "(rollout.max_staleness > 0) and rollout_mask is off, else off"),
    Bound("algorithm.rollout_mask", "'', 'token' or 'sequence'", lambda v: v in ROLLOUT_CORRECTION_LEVELS,
          "'' turns masked importance sampling off; 'token' drops the tokens whose pi_train / pi_rollout leaves "
          "[rollout_mask_low, rollout_mask_high]"),
    Bound("rollout.max_staleness", ">= 0", _at_least(0), "use 0 (on-policy), or 1 to generate the next step's "
          "rollouts while this step trains"),
    Bound("rollout.ranks", ">= 1", _at_least(1), "use e.g. 1"),
    Bound("algorithm.rollout_is_cap", ">= 1", _at_least(1), "use e.g. 2.0 (weights above it are capped)"),
    Bound("algorithm.rollout_mask_low", "in (0, 1]", _fraction, "use e.g. 0.5"),
    Bound("algorithm.rollout_mask_high", ">= 1", _at_least(1), "use e.g. 2.0"),
    Bound("algorithm.kl_horizon", ">= 1", _at_least(1), "use e.g. 10000"),
    Bound("algorithm.max_sampling_rounds", ">= 1", _at_least(1), "use e.g. 4 (rounds of prompts dynamic sampling "
          "may draw per step)"),
    Bound("algorithm.overlong_buffer", ">= 0", _at_least(0), "use 0 for no overlong penalty"),
    Bound("algorithm.overlong_factor", ">= 0", _at_least(0), "use e.g. 1.0"),
    Bound("algorithm.lagrange_lr", ">= 0", _at_least(0), "use e.g. 0.1"),
    Bound("task.eval_size", ">= 1", _at_least(1), "use e.g. 64 held-out examples"),
    *(Bound(f"trainer.{key}", ">= 0", _at_least(0), "use 0 to turn it off") for key in ("save_every", "eval_every")),
    Bound("trainer.steps", ">= 0", _at_least(0), "use e.g. 20"),
    Bound("trainer.logged_samples", ">= 0", _at_least(0), "use e.g. 8"),
    Bound("trainer.capture_steps", ">= 0", _at_least(0), "use 0 to keep every step's captures"),
    Bound("trainer.on_nonfinite", "'stop' or 'skip'", lambda v: v in ("stop", "skip"), "a NaN/inf loss or "
          "gradient norm either stops the run or drops that optimizer step; nothing is applied either way"),
    Bound("task.reward_on_error", "'fail' or 'zero'", lambda v: v in ("fail", "zero"), "a row the reward "
          "function cannot score either stops the step, showing the row, or scores 0 and is counted"),
    Bound("task.reward_timeout_s", ">= 0", _at_least(0), "use 0 for no timeout, or the seconds one row may take"),
)
OPTIM_BOUNDS = (
    Bound("optim.lr", "> 0", _positive, "use e.g. 1e-5 (1e-6 for larger models)"),
    Bound("optim.weight_decay", ">= 0", _at_least(0), "use 0.0 or e.g. 0.01"),
    Bound("optim.eps", "> 0", _positive, "use e.g. 1e-8"),
    Bound("optim.betas", "in [0, 1) each", lambda betas: all(0 <= b < 1 for b in betas), "use e.g. [0.9, 0.999]"),
    Bound("optim.warmup_steps", ">= 0", _at_least(0), "use 0 for no warm-up"),
    Bound("optim.min_lr_ratio", "in [0, 1]", _probability, "use e.g. 0.1 (cosine decays to lr * min_lr_ratio)"),
    Bound("optim.grad_clip", ">= 0", _at_least(0), "use e.g. 1.0, or 0 to turn clipping off"),
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(config: LabConfig, roles: tuple[str, ...] = ("actor", "critic")) -> None:
    """Raise ``ConfigError`` for the first setting that cannot work with the others."""
    if config.backend not in ("ray", "local"):
        raise ConfigError("backend", f"must be 'ray' or 'local', got {config.backend!r}")
    _check_bounds(config, BOUNDS)
    for name in roles:
        _check_bounds(config, [bound._replace(key=f"{name}.{bound.key}") for bound in OPTIM_BOUNDS])
    _check_overlong_buffer(config)
    _check_batch(config)
    for name in roles:
        _check_role(config, name, getattr(config, name))
    pooled = (*roles, "rollout") if config.rollout.pool else roles  # a rollout group of its own has a pool too
    _check_pools(config, pooled)
    _check_device(config, pooled)
    _check_rollout(config)
    _check_vocabulary(config, roles)
    if config.reward_model_path and not has_trained_head(config.reward_model_path):
        raise ConfigError("reward_model_path", untrained_head_message(config.reward_model_path))


def _check_bounds(config: LabConfig, bounds: Iterable[Bound]) -> None:
    for bound in bounds:
        value = reduce(getattr, bound.key.split("."), config)
        if not bound.holds(value):
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(bound.key, f"must be {bound.rule}, got {shown}; {bound.fix}")


def _check_overlong_buffer(config: LabConfig) -> None:
    buffer, max_new_tokens = config.algorithm.overlong_buffer, config.rollout.max_new_tokens
    if buffer >= max_new_tokens:
        raise ConfigError("algorithm.overlong_buffer", f"{buffer} leaves no response length unpenalised under "
                          f"rollout.max_new_tokens={max_new_tokens}; use less than {max_new_tokens} (DAPO uses about "
                          "a fifth of it), or 0 for no penalty")


def _check_batch(config: LabConfig) -> None:
    batch = config.batch
    step = batch.step_sequences
    if step % batch.update_minibatch_sequences:
        raise ConfigError(
            "batch.update_minibatch_sequences",
            f"{batch.update_minibatch_sequences} does not divide the {step} sequences of a step (rollout_batch_prompts "
            f"{batch.rollout_batch_prompts} x samples_per_prompt {batch.samples_per_prompt}); use one of "
            f"{divisors(step)}",
        )
    budget, rollout = batch.micro_batch_tokens_per_rank, config.rollout
    longest = rollout.max_prompt_tokens + rollout.max_new_tokens
    if 0 < budget < longest:
        raise ConfigError(
            "batch.micro_batch_tokens_per_rank",
            f"{budget} tokens cannot hold one sequence of up to {longest} (rollout.max_prompt_tokens "
            f"{rollout.max_prompt_tokens} + rollout.max_new_tokens {rollout.max_new_tokens}); use at least {longest} "
            f"(a few sequences' worth, e.g. {4 * longest}), or 0 to size micro-batches by sequences",
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
    if role.engine.backend == "deepspeed" and config.trainer.on_nonfinite == "skip":
        raise ConfigError("trainer.on_nonfinite", f"the deepspeed engine of the {name} cannot drop an optimizer "
                          f"step; use stop, or {name}.engine.backend=torch or fsdp")
    if role.lora.enabled and role.engine.tensor_parallel > 1:
        raise ConfigError(f"{name}.lora.rank", f"LoRA adapters are not built for tensor-parallel shards ({name}"
                          f".engine.tensor_parallel={role.engine.tensor_parallel}); set {name}.lora.rank=0 for full "
                          f"fine-tuning, or {name}.engine.tensor_parallel=1")
    if role.engine.torch_compile:
        _check_compiled_layers(config, name, role)
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


def compiled_layers_refusal(name: str, engine: EngineConfig) -> str | None:
    """Why ``{name}.engine.torch_compile`` cannot run on ``engine`` (training TP, FSDP, ZeRO-3), or None when it
    can (a C++ compiler aside)."""
    key = f"{name}.engine.torch_compile"
    if engine.tensor_parallel > 1:
        return f"the compiled layers run no collectives; set {name}.engine.tensor_parallel=1 or {key}=false"
    sharded = {"fsdp": "FSDP", "deepspeed": "ZeRO-3" if engine.zero_stage == 3 else ""}.get(engine.backend)
    if sharded:
        return (f"{sharded} gathers parameters in hooks on each layer's modules, which the compiled layers are not "
                f"built to trace; use {name}.engine.backend=torch, or deepspeed with {name}.engine.zero_stage=1 or "
                f"2, or set {key}=false")
    return None


def _check_compiled_layers(config: LabConfig, name: str, role: RoleConfig) -> None:
    key = f"{name}.engine.torch_compile"
    refusal = compiled_layers_refusal(name, role.engine)
    if refusal:
        raise ConfigError(key, refusal)
    _check_cpp_compiler(config, key)


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
                          f"{name} ({name}.ranks); use one of {divisors(role.ranks)}, or set {name}.ranks to a "
                          f"multiple of {tp}")
    return role.ranks // tp


def _check_pools(config: LabConfig, roles: tuple[str, ...]) -> None:
    """Roles sharing a pool are colocated rank by rank, so they need the same ranks on the same nodes."""
    first_on_pool: dict[str, str] = {}
    for name in roles:
        role: RoleConfig | RolloutConfig = getattr(config, name)
        if not role.pool:
            raise ConfigError(f"{name}.pool", "must name a resource pool (e.g. 'main')")
        _check_nodes(name, role)
        other = first_on_pool.setdefault(role.pool, name)
        other_ranks, other_nodes = getattr(config, other).ranks, getattr(config, other).nodes
        if role.ranks != other_ranks:
            raise ConfigError(
                f"{name}.pool", f"{name} ({role.ranks} ranks) is colocated with {other} ({other_ranks} ranks) on pool "
                f"{role.pool!r}; colocated roles need the same ranks: set {name}.ranks={other_ranks}, or "
                f"{name}.pool={name} to give it its own devices",
            )
        if role.nodes != other_nodes:
            raise ConfigError(f"{name}.nodes", f"{name} is colocated with {other} on pool {role.pool!r}, which spans "
                              f"{other_nodes} node(s); set {name}.nodes={other_nodes}, or {name}.pool={name}")


def _check_nodes(name: str, role: RoleConfig | RolloutConfig) -> None:
    if role.nodes < 1 or role.ranks % role.nodes:
        raise ConfigError(f"{name}.nodes", f"{role.nodes} nodes cannot hold the {role.ranks} ranks of the {name} "
                          f"evenly; use one of {divisors(role.ranks)}")


def visible_gpus(backend: str) -> int | None:
    """GPUs the run's ranks can be placed on: the joined Ray cluster's, else this machine's (None: not known
    before joining the cluster ``HYBRIDFLOW_RAY_ADDRESS`` names)."""
    import ray

    from hybridflow_lab.controller.cluster import ADDRESS_ENV

    if backend == "ray" and ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    if backend == "ray" and os.environ.get(ADDRESS_ENV):
        return None
    return torch.cuda.device_count()


def resolve_device(config: LabConfig, gpus: int | None = None) -> str:
    """``device``, with ``auto`` made ``cuda`` when there are GPUs for the ranks (``gpus``, else
    ``visible_gpus``) and ``cpu`` otherwise."""
    if config.device != "auto":
        return config.device
    return "cuda" if (gpus if gpus is not None else visible_gpus(config.backend)) else "cpu"


def _check_device(config: LabConfig, roles: tuple[str, ...]) -> None:
    """GPUs asked for exist, one per rank of every pool, and support the training dtype."""
    if config.device not in DEVICES:
        raise ConfigError("device", f"{config.device!r} is not one of {DEVICES}")
    gpus = visible_gpus(config.backend)
    if resolve_device(config, gpus) != "cuda":
        return
    slots = config.pool_slots(roles)
    if gpus == 0:
        raise ConfigError("device", f"cuda asks for GPUs but torch {torch.__version__} (CUDA build: "
                          f"{torch.version.cuda or 'none'}) sees none here; use device=cpu (or auto), or run on a "
                          "machine with GPUs and a CUDA build of torch")
    if gpus is not None and sum(slots.values()) > gpus:
        needed = " + ".join(f"{pool} {n}" for pool, n in slots.items())
        raise ConfigError(f"{roles[0]}.ranks", f"the pools need one GPU per rank ({needed}) but {gpus} exist; use "
                          "fewer ranks, or colocate roles on one pool (critic.pool=main)")
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        for name in (role for role in roles if role != "rollout"):
            if getattr(config, name).engine.bf16:
                raise ConfigError(f"{name}.engine.bf16", f"{torch.cuda.get_device_name()} has no bfloat16; set "
                                  f"{name}.engine.bf16=false")


def _check_rollout(config: LabConfig) -> None:
    rollout = config.rollout
    if rollout.engine not in ROLLOUT_ENGINES:
        raise ConfigError("rollout.engine", f"{rollout.engine!r} is not one of {ROLLOUT_ENGINES}")
    if rollout.reshard not in RESHARD_STRATEGIES:
        raise ConfigError("rollout.reshard", f"{rollout.reshard!r} is not one of {RESHARD_STRATEGIES}")
    model = _model(config.actor.model_path, "actor.model_path")
    t, tg = config.actor.engine.tensor_parallel, rollout.tensor_parallel
    _check_shardable(model, "actor.engine.tensor_parallel", t)
    _check_shardable(model, "rollout.tensor_parallel", tg)
    if t % tg and rollout.engine != "vllm":  # vLLM shards the full weights itself
        raise ConfigError("rollout.tensor_parallel", f"generation TP {tg} must divide the actor's training TP {t} "
                          f"(actor.engine.tensor_parallel), so each generation shard is whole training shards; use "
                          f"one of {divisors(t)}, or raise actor.engine.tensor_parallel")
    context = getattr(model, "max_position_embeddings", None)
    if context and rollout.max_prompt_tokens + rollout.max_new_tokens > context:
        raise ConfigError("rollout.max_prompt_tokens", f"{rollout.max_prompt_tokens} prompt tokens + "
                          f"rollout.max_new_tokens={rollout.max_new_tokens} is more than the {context} positions of "
                          f"{config.actor.model_path} (config.json's max_position_embeddings); lower them to fit")
    if rollout.dtype not in VLLM_DTYPES:
        raise ConfigError("rollout.dtype", f"{rollout.dtype!r} is not one of {VLLM_DTYPES}; leave it empty for the "
                          "actor's training dtype")
    if rollout.forced_lengths:
        _check_forced_lengths(config)
    if rollout.torch_compile:
        _check_torch_compile(config)
    if rollout.onednn_decode:
        _check_onednn_decode(config)
    if rollout.engine == "vllm":
        _check_vllm(config, model)


def _check_forced_lengths(config: LabConfig) -> None:
    rollout = config.rollout
    if rollout.engine != "torch":
        raise ConfigError("rollout.forced_lengths", "only the built-in engine forces response lengths; set "
                          "rollout.engine=torch or rollout.forced_lengths=[]")
    if rollout.ignore_eos:
        raise ConfigError("rollout.forced_lengths", "forced lengths end each response with EOS; set "
                          "rollout.ignore_eos=false")
    if not all(1 <= length <= rollout.max_new_tokens for length in rollout.forced_lengths):
        raise ConfigError("rollout.forced_lengths", f"{list(rollout.forced_lengths)} must each be in [1, "
                          f"rollout.max_new_tokens={rollout.max_new_tokens}]")


def _check_torch_compile(config: LabConfig) -> None:
    rollout = config.rollout
    if rollout.engine != "torch":
        raise ConfigError("rollout.torch_compile", f"compiles the built-in engine's decoding step, and rollout.engine "
                          f"is {rollout.engine!r}; set rollout.engine=torch or rollout.torch_compile=false")
    if rollout.tensor_parallel != 1:
        raise ConfigError("rollout.torch_compile", "the compiled decoding step runs no collectives; set "
                          "rollout.tensor_parallel=1 or rollout.torch_compile=false")
    _check_cpp_compiler(config, "rollout.torch_compile")


def _check_onednn_decode(config: LabConfig) -> None:
    rollout, key = config.rollout, "rollout.onednn_decode"
    if rollout.engine != "torch":
        raise ConfigError(key, f"is the built-in engine's decoding step, and rollout.engine is {rollout.engine!r}; set "
                          f"rollout.engine=torch or {key}=false")
    if rollout.torch_compile:
        raise ConfigError(key, "and rollout.torch_compile each choose how the decoding step runs; set one of them to "
                          "false")
    if rollout.tensor_parallel != 1:
        raise ConfigError(key, f"the oneDNN decoding step runs no collectives; set rollout.tensor_parallel=1 or "
                          f"{key}=false")
    if resolve_device(config) != "cpu":
        raise ConfigError(key, f"packs the weights for oneDNN's CPU kernels, and the actor runs on "
                          f"{resolve_device(config)}; set {key}=false (rollout.torch_compile runs on a GPU too)")
    if config.actor.engine.bf16:
        raise ConfigError(key, f"the oneDNN decoding step computes in float32, and actor.engine.bf16 generates in "
                          f"bfloat16; set actor.engine.bf16=false or {key}=false")
    missing = missing_onednn()
    if missing:
        raise ConfigError(key, f"{missing}; set {key}=false")
    _check_cpp_compiler(config, key)


def _check_cpp_compiler(config: LabConfig, key: str) -> None:
    missing = missing_cpp_compiler() if resolve_device(config) == "cpu" else None
    if missing:
        raise ConfigError(key, f"{missing}; install one (g++) or set {key}=false")


def _check_vllm(config: LabConfig, model: PretrainedConfig) -> None:
    rollout = config.rollout
    tg, ranks = rollout.tensor_parallel, config.actor.ranks
    if tg not in (1, ranks):
        raise ConfigError("rollout.tensor_parallel", f"vLLM runs either one replica per rank (1) or one engine "
                          f"tensor-parallel over all {ranks} actor ranks ({ranks}); {tg} would need vLLM's data "
                          "parallel across the ranks, which is not built; use 1 or actor.ranks, or "
                          "rollout.engine=torch")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm is not installed in this environment; on the CPU `make lab` (or "
                          "`make test`) installs vLLM's CPU build into .venv, the kernel JupyterLab starts from "
                          "there; on a GPU machine pip install -e '.[gpu]'; or use rollout.engine=torch")
    from vllm import ModelRegistry

    architecture = (model.architectures or [type(model).__name__])[0]
    if architecture not in ModelRegistry.get_supported_archs():
        raise ConfigError("actor.model_path", f"vLLM cannot load {architecture} (the model's config.json "
                          "architectures); use rollout.engine=torch for it, or a model vLLM supports")
    if not torch.cuda.is_available():
        import psutil

        free = psutil.virtual_memory().available / 2**30
        if rollout.kv_cache_gib * ranks > KV_CACHE_SHARE * free:
            raise ConfigError("rollout.kv_cache_gib", f"{ranks} vLLM engines x {rollout.kv_cache_gib} GiB of KV "
                              f"cache is more than {KV_CACHE_SHARE:.0%} of the {free:.1f} GiB this machine has free; "
                              f"use at most {max(1, int(KV_CACHE_SHARE * free) // ranks)}")


def _check_vocabulary(config: LabConfig, roles: tuple[str, ...]) -> None:
    """Every model embeds every id of the actor's tokenizer (the one that encodes prompts for all of them)."""
    path = config.actor.model_path
    size = len(_tokenizer(path))
    models = {f"{name}.model_path": getattr(config, name).model_path or path for name in roles}
    if config.reward_model_path:
        models["reward_model_path"] = config.reward_model_path
    for key, model_path in models.items():
        vocab = _model(model_path, key).vocab_size
        if size > vocab:
            raise ConfigError(key, f"{model_path} has vocab_size {vocab} but the actor's tokenizer ({path}) has "
                              f"{size} tokens, so ids {vocab} and up have no embedding; use the tokenizer the model "
                              f"was built with, or a model whose vocab_size is at least {size}")


def _tokenizer(path: str) -> Any:
    # without tokenizer files transformers quietly builds an empty tokenizer from config.json's model_type
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError("actor.model_path", f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save "
                          f"the model's tokenizer there with tokenizer.save_pretrained({path!r}), or create the "
                          "directory with hybridflow_lab.models.create_model_dir")
    return load_tokenizer(path)


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
