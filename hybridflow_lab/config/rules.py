"""The rules between a configuration's settings: pure functions of the config (no I/O, no torch, no model code),
run before any worker starts; each error names the key and the fix. What the machine and the model files must
offer is checked by ``hybridflow_lab.dataflows.preflight``."""

from __future__ import annotations

from hybridflow_lab.config.batch_sizes import check_batch_sizes, divisors
from hybridflow_lab.config.bounds import check_bounds
from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.pipeline_rules import check_pipeline, check_schedule
from hybridflow_lab.config.schema import EngineConfig, LabConfig, RoleConfig, RolloutConfig


def validate(config: LabConfig, roles: tuple[str, ...] = ("actor", "critic")) -> None:
    """Raise ``ConfigError`` for the first setting that cannot work with the others (the batch sizes: all of
    their conflicts at once); ``roles`` are the trained ones."""
    check_bounds(config, roles)
    _check_overlong_buffer(config)
    data_parallel = {name: _check_role(config, name, getattr(config, name)) for name in roles}
    check_batch_sizes(config, data_parallel)
    if "actor" in data_parallel:
        check_schedule(config, data_parallel["actor"])
    _check_pools(config, (*roles, "rollout") if config.rollout.pool else roles)  # a rollout group has a pool too
    _check_rollout(config)
    _check_agent(config)


def _check_agent(config: LabConfig) -> None:
    if config.agent.tool_workers and config.backend != "ray":
        raise ConfigError("agent.tool_workers", f"is {config.agent.tool_workers}, but its workers are Ray actors and "
                          f"backend is {config.backend!r}; use backend=ray, or agent.tool_workers=0 to run the tools "
                          "on the controller")


def _check_overlong_buffer(config: LabConfig) -> None:
    buffer, max_new_tokens = config.algorithm.overlong_buffer, config.rollout.max_new_tokens
    if buffer >= max_new_tokens:
        raise ConfigError("algorithm.overlong_buffer", f"{buffer} leaves no response length unpenalised under "
                          f"rollout.max_new_tokens={max_new_tokens}; use less than {max_new_tokens} (DAPO uses about "
                          "a fifth of it), or 0 for no penalty")


def _check_role(config: LabConfig, name: str, role: RoleConfig) -> int:
    """The role's settings that do not concern the batch sizes; returns its data-parallel size."""
    if role.ranks < 1:
        raise ConfigError(f"{name}.ranks", f"must be >= 1, got {role.ranks}")
    if config.backend == "local" and role.ranks != 1:
        raise ConfigError(f"{name}.ranks", "the local backend runs one rank per role; set it to 1 or use backend=ray")
    if role.engine.backend == "deepspeed" and config.trainer.on_nonfinite == "skip":
        raise ConfigError("trainer.on_nonfinite", f"the deepspeed engine of the {name} cannot drop an optimizer "
                          f"step; use stop, or {name}.engine.backend=torch or fsdp")
    if role.lora.enabled and role.engine.tensor_parallel > 1:
        raise ConfigError(f"{name}.lora.rank", f"LoRA adapters are not built for tensor-parallel shards ({name}"
                          f".engine.tensor_parallel={role.engine.tensor_parallel}); leave {name}.lora.rank unset "
                          f"for full fine-tuning, or set {name}.engine.tensor_parallel=1")
    check_pipeline(config, name, role)
    if role.engine.torch_compile:
        refusal = compiled_layers_refusal(name, role.engine)
        if refusal:
            raise ConfigError(f"{name}.engine.torch_compile", refusal)
    return _data_parallel(name, role)


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
    p = role.engine.pipeline_parallel
    if (role.ranks // tp) % p:
        raise ConfigError(f"{name}.engine.pipeline_parallel", f"{p} stages x {tp} tensor shards do not divide the "
                          f"{role.ranks} ranks of the {name} ({name}.ranks); use one of {divisors(role.ranks // tp)}, "
                          f"or set {name}.ranks to a multiple of {p * tp}")
    return role.ranks // (tp * p)


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


def _check_rollout(config: LabConfig) -> None:
    rollout = config.rollout
    t, tg = config.actor.engine.tensor_parallel, rollout.tensor_parallel
    if t % tg and rollout.engine != "vllm":  # vLLM shards the full weights itself
        raise ConfigError("rollout.tensor_parallel", f"generation TP {tg} must divide the actor's training TP {t} "
                          f"(actor.engine.tensor_parallel), so each generation shard is whole training shards; use "
                          f"one of {divisors(t)}, or raise actor.engine.tensor_parallel")
    if rollout.forced_lengths:
        _check_forced_lengths(rollout)
    if rollout.decoding != "eager":
        _check_decoding(config)
    if rollout.engine == "vllm" and tg not in (1, config.actor.ranks):
        ranks = config.actor.ranks
        raise ConfigError("rollout.tensor_parallel", f"vLLM runs either one replica per rank (1) or one engine "
                          f"tensor-parallel over all {ranks} actor ranks ({ranks}); {tg} would need vLLM's data "
                          "parallel across the ranks, which is not built; use 1 or actor.ranks, or "
                          "rollout.engine=torch")


def _check_forced_lengths(rollout: RolloutConfig) -> None:
    if rollout.engine != "torch":
        raise ConfigError("rollout.forced_lengths", "only the built-in engine forces response lengths; set "
                          "rollout.engine=torch or rollout.forced_lengths=[]")
    if rollout.ignore_eos:
        raise ConfigError("rollout.forced_lengths", "forced lengths end each response with EOS; set "
                          "rollout.ignore_eos=false")
    if not all(1 <= length <= rollout.max_new_tokens for length in rollout.forced_lengths):
        raise ConfigError("rollout.forced_lengths", f"{list(rollout.forced_lengths)} must each be in [1, "
                          f"rollout.max_new_tokens={rollout.max_new_tokens}]")


def _check_decoding(config: LabConfig) -> None:
    """The compiled and oneDNN decoding steps: the built-in engine's, on one rank's whole model; oneDNN's on the
    CPU in float32 (the device, the compiler, oneDNN and the architecture: ``preflight``)."""
    rollout = config.rollout
    key, step = "rollout.decoding", {"compiled": "the compiled", "onednn": "the oneDNN"}[rollout.decoding]
    if rollout.engine != "torch":
        raise ConfigError(key, f"{rollout.decoding} is {step} decoding step of the built-in engine, and rollout.engine "
                          f"is {rollout.engine!r}; set rollout.engine=torch or {key}=eager")
    if rollout.tensor_parallel != 1:
        raise ConfigError(key, f"{step} decoding step runs no collectives; set rollout.tensor_parallel=1 or "
                          f"{key}=eager")
    if rollout.decoding == "onednn" and config.device == "cuda":
        raise ConfigError(key, f"onednn packs the weights for oneDNN's CPU kernels, and device is cuda; set {key}="
                          "compiled (it runs on a GPU too) or eager")
    if rollout.decoding == "onednn" and config.actor.engine.bf16:
        raise ConfigError(key, f"the oneDNN decoding step computes in float32, and actor.engine.bf16 generates in "
                          f"bfloat16; set actor.engine.bf16=false or {key}=compiled")
