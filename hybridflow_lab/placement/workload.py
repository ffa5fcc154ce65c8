"""What the placement search places: each model's shape and the RLHF iteration's sizes.

A ``ModelSpec`` carries the numbers the cost model needs (parameters, FLOPs and KV-cache bytes per
token); a ``Workload`` names the models by role and sizes one PPO-style iteration. Both come from a
``LabConfig`` (the models on disk) or from the paper's setting (Llama 7B-70B, 1024-token prompts and
responses, 1024 prompts per batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from hybridflow_lab.config import LabConfig
from hybridflow_lab.dataflows import RunNeeds
from hybridflow_lab.models.factory import load_config

# The roles of an RLHF iteration, in the paper's order; "reward" and "cost" score, the others train or infer.
ROLES = ("actor", "critic", "reference", "reward", "cost")
TRAINED = ("actor", "critic")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shape; ``value_head`` models (critic, reward, cost) end in one output instead of the vocabulary."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    value_head: bool = False

    @classmethod
    def from_hf(cls, config: PretrainedConfig, name: str = "", value_head: bool = False) -> ModelSpec:
        return cls(name or config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads, config.vocab_size, value_head)

    def as_value_model(self) -> ModelSpec:
        return ModelSpec(self.name, self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads,
                         self.vocab, value_head=True)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Parameter count: attention, gated MLP and norms per layer, the embedding and the output head."""
        kv = self.kv_heads * self.head_dim
        layer = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden + 3 * self.hidden * self.intermediate
        output = self.hidden if self.value_head else self.vocab * self.hidden
        return self.layers * (layer + 2 * self.hidden) + self.vocab * self.hidden + output

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs for one token attending to ``context`` tokens: 2 per weight, plus the attention scores."""
        return 2.0 * self.params + 4.0 * self.layers * self.hidden * context

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies (keys and values of every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# Llama 2 7B/13B/70B and Code Llama 34B shapes (the paper's models), vocabulary 32000.
LLAMA = {
    "7B": ModelSpec("llama-7b", 32, 4096, 11008, 32, 32, 32000),
    "13B": ModelSpec("llama-13b", 40, 5120, 13824, 40, 40, 32000),
    "34B": ModelSpec("llama-34b", 48, 8192, 22016, 64, 8, 32000),
    "70B": ModelSpec("llama-70b", 80, 8192, 28672, 64, 8, 32000),
}


@dataclass(frozen=True)
class Workload:
    """One iteration: ``prompts`` x ``samples_per_prompt`` sequences of ``prompt_tokens`` + ``response_tokens``.

    ``models`` maps each role that runs to its spec; ``dtype_bytes`` is the weights' and activations'
    element size (2 for bf16 on GPUs, 4 for float32 on this CPU machine); training keeps fp32 Adam state.
    """

    models: dict[str, ModelSpec]
    prompts: int
    prompt_tokens: int
    response_tokens: int
    samples_per_prompt: int = 1
    update_epochs: int = 1
    micro_batch_sequences: int = 8
    micro_batch_tokens: int = 0  # > 0: micro-batches cut by this many tokens (verl's use_dynamic_bsz), not sequences
    dtype_bytes: int = 2
    recompute_log_probs: bool = True  # False: one optimizer step per batch, the update's forward gives them
    name: str = "workload"
    stages: tuple[str, ...] = ("generation", "preparation", "training")

    def __post_init__(self) -> None:
        unknown = set(self.models) - set(ROLES)
        if unknown or "actor" not in self.models:
            raise ValueError(f"workload models must include 'actor' and come from {ROLES}; got {sorted(self.models)}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens_per_micro_batch(self) -> int:
        """The most tokens one training or inference pass holds: the token budget, or that many full sequences."""
        return self.micro_batch_tokens or self.micro_batch_sequences * self.sequence_tokens

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(role for role in ROLES if role in self.models)

    @classmethod
    def paper_ppo(cls, size: str) -> Workload:
        """The paper's PPO setting: four Llama models of one size, 1024 prompts of 1024 tokens, 1024-token responses."""
        actor = LLAMA[size]
        return cls({"actor": actor, "critic": actor.as_value_model(), "reference": actor,
                    "reward": actor.as_value_model()}, prompts=1024, prompt_tokens=1024, response_tokens=1024,
                   micro_batch_sequences=8, name=f"ppo-llama-{size}")


def workload_from_config(config: LabConfig) -> Workload:
    """The workload a run's config describes: its models from disk, its batch and lengths, float32 on CPU."""
    needs = RunNeeds.of(config)
    actor = ModelSpec.from_hf(load_config(config.actor.model_path), "actor")
    models = {"actor": actor}
    if needs.reference_model:
        models["reference"] = actor
    if needs.critic:
        critic_path = config.critic.model_path
        models["critic"] = ModelSpec.from_hf(load_config(critic_path), "critic", True) if critic_path \
            else actor.as_value_model()
    if needs.reward_model:
        models["reward"] = ModelSpec.from_hf(load_config(config.reward_model_path), "reward", True)
    batch = config.batch
    return Workload(models, prompts=batch.rollout_batch_prompts, prompt_tokens=config.rollout.max_prompt_tokens,
                    response_tokens=config.rollout.max_new_tokens, samples_per_prompt=batch.samples_per_prompt,
                    update_epochs=batch.update_epochs, micro_batch_sequences=batch.micro_batch_sequences_per_rank,
                    micro_batch_tokens=batch.micro_batch_tokens_per_rank, dtype_bytes=4,
                    recompute_log_probs=needs.old_log_probs,
                    name=f"{config.algorithm.name}-{config.task.name}")
