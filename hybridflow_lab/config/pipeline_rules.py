"""The rules of pipeline-parallel training (``actor.engine.pipeline_parallel``, the paper's p): what the stages run
on, and the micro-batches the 1F1B schedule needs. What the model files must allow (a layer per stage, untied
embeddings, the project's decoder) is checked by ``dataflows.preflight``."""

from __future__ import annotations

from hybridflow_lab.config.batch_sizes import divisors
from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import LabConfig, RoleConfig


def check_pipeline(config: LabConfig, name: str, role: RoleConfig) -> None:
    """Raise ``ConfigError`` naming the key when ``role``'s pipeline stages cannot run with its other settings."""
    engine, p = role.engine, role.engine.pipeline_parallel
    key = f"{name}.engine.pipeline_parallel"
    if p < 1:
        raise ConfigError(key, f"must be >= 1, got {p}; use 1 for no pipeline stages")
    if p == 1:
        return
    if name != "actor":
        raise ConfigError(key, "only the actor trains pipeline-parallel (the hybrid engine regroups its stages for "
                               "generation); use 1")
    stages = f"the {p} pipeline stages ({key}={p})"
    refused = {
        f"{name}.engine.backend": (engine.backend != "torch", f"{stages} run on the torch engine (DDP over each "
                                   f"stage's replicas), not {engine.backend}; set {name}.engine.backend=torch"),
        f"{name}.engine.remove_padding": (engine.remove_padding, f"{stages} pass activations of one padded shape "
                                          f"between ranks; set {name}.engine.remove_padding=false"),
        "batch.micro_batch_tokens_per_rank": (config.batch.micro_batch_tokens_per_rank > 0, f"{stages} run "
                                              "micro-batches of one shape; set it to 0 (micro-batches by sequences, "
                                              "batch.micro_batch_sequences_per_rank)"),
        f"{name}.lora.rank": (role.lora.enabled, f"LoRA adapters are not built for {stages}; leave {name}.lora.rank "
                              f"unset for full fine-tuning, or set {key}=1"),
        f"{name}.engine.torch_compile": (engine.torch_compile, f"the compiled layers are not built for {stages}; "
                                         f"set {name}.engine.torch_compile=false or {key}=1"),
    }
    for refused_key, (refuse, why) in refused.items():
        if refuse:
            raise ConfigError(refused_key, why)


def check_schedule(config: LabConfig, data_parallel: int) -> None:
    """The 1F1B schedule runs each optimizer step's micro-batches through ``p`` stages: it needs at least ``p`` of
    them on every actor rank (``data_parallel``: the actor's replicas); the batch sizes are assumed consistent."""
    engine, batch = config.actor.engine, config.batch
    p = engine.pipeline_parallel
    if p == 1 or engine.pipeline_schedule != "1f1b":
        return
    per_rank, micro = batch.update_minibatch_sequences // data_parallel, batch.micro_batch_sequences_per_rank
    if per_rank // micro < p:
        working = [size for size in divisors(per_rank) if per_rank // size >= p]
        fix = f"use at most {working[-1]}" if working else \
            f"raise batch.update_minibatch_sequences to {p * data_parallel}"
        raise ConfigError("batch.micro_batch_sequences_per_rank", f"{micro} makes {per_rank // micro} micro-batch(es) "
                          f"per optimizer step on each actor rank ({per_rank} sequences), and the 1F1B schedule of "
                          f"{p} stages needs at least {p}; {fix}, or set actor.engine.pipeline_schedule=gpipe")
