"""The run configuration: typed dataclasses, one per section, with the defaults of the CPU demo."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow_lab.engines.train_base import OptimConfig


@dataclass
class EngineConfig:
    """How a trained role shards its model: ``torch`` (DDP), ``deepspeed`` (ZeRO) or ``fsdp`` (FSDP2)."""

    backend: str = "deepspeed"
    zero_stage: int = 2
    offload: bool = False
    bf16: bool = False


@dataclass
class RoleConfig:
    """A model role: where its weights come from, how many data-parallel ranks, how it trains."""

    model_path: str = ""  # empty: the actor's model
    ranks: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass
class RolloutConfig:
    """Generation: sampling and the engine (``torch`` built-in, or ``vllm`` on GPU)."""

    engine: str = "torch"
    max_prompt_tokens: int = 32
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    tensor_parallel: int = 1  # generation TP size (the paper's tg)
    gpu_memory_utilization: float = 0.5  # vllm only


@dataclass
class BatchConfig:
    """Batch sizes, each named by what it counts (see docs/batch-sizes.md)."""

    rollout_batch_prompts: int = 16  # prompts drawn per RL step
    samples_per_prompt: int = 4  # responses generated per prompt (the GRPO group size)
    update_minibatch_sequences: int = 64  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_sequences_per_rank: int = 8  # sequences per forward/backward on one rank
    update_epochs: int = 1  # passes over the step's sequences

    @property
    def step_sequences(self) -> int:
        return self.rollout_batch_prompts * self.samples_per_prompt


@dataclass
class LabConfig:
    """Everything a run needs. ``actor.model_path`` is the policy (and the reference policy)."""

    backend: str = "ray"  # or "local": every role in this process, one rank each
    seed: int = 0
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(ranks=2))
    critic: RoleConfig = field(default_factory=lambda: RoleConfig(ranks=2, optim=OptimConfig(lr=1e-5)))
    reward_model_path: str = ""  # empty: rule rewards only
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
