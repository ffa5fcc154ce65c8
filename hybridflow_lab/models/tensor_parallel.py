"""Megatron-style tensor parallelism for the one decoder definition: which weights split along which
dimension, the collectives a sharded forward needs (with their gradients), and state-dict sharding.

Column-parallel layers (q/k/v, gate/up, the LM head, and the vocabulary of the embedding) split
their output rows; row-parallel layers (o_proj, down_proj) split their input columns and all-reduce
their outputs. Norm weights are replicated. A ``TensorParallel`` of size 1 makes every helper a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from hybridflow_lab.models.families import output_bias

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (``group`` is a torch.distributed process group)."""

    size: int = 1
    rank: int = 0
    group: Any = None

    @property
    def enabled(self) -> bool:
        return self.size > 1


SINGLE = TensorParallel()


def split_dim(name: str) -> int | None:
    """The dimension a parameter is split along (0: column-parallel, 1: row-parallel), None if replicated."""
    module = name.split(".")[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and name.endswith(".weight"):
        return 1
    return None


def check_shardable(config: PretrainedConfig, size: int) -> None:
    """Raise ``ValueError`` naming the dimension that ``size`` tensor-parallel ranks cannot split."""
    dims = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for key, value in dims.items():
        if value % size:
            raise ValueError(f"tensor-parallel size {size} does not divide the model's {key} ({value}); use one of "
                             f"{[s for s in range(1, value + 1) if all(v % s == 0 for v in dims.values())]}")
    if size > 1 and (getattr(config, "mlp_bias", False) or output_bias(config)):
        raise ValueError("tensor parallelism does not support output-projection biases (mlp_bias/attention_bias)")


def shard(tensor: torch.Tensor, name: str, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a full parameter (a copy), or the parameter itself if replicated."""
    dim = split_dim(name)
    if dim is None or not tp.enabled or tensor.dim() == 0:
        return tensor
    return tensor.chunk(tp.size, dim=dim)[tp.rank].clone()


def shard_state_dict(state: dict[str, torch.Tensor], tp: TensorParallel) -> dict[str, torch.Tensor]:
    return {name: shard(value, name, tp) for name, value in state.items()}


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input gradient over the group (column-parallel input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Sums partial outputs over the group (row-parallel output); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Concatenates the ranks' slices along the last dimension; the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def copy_to_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToParallel.apply(x, tp.group) if tp.enabled and torch.is_grad_enabled() else x


def reduce_from_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, tp.group) if tp.enabled else x


def gather_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _GatherLastDim.apply(x, tp) if tp.enabled else x


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose vocabulary rows are split over the group; lookups outside this rank's rows give 0."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab // tp.size
        self.weight = torch.nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.rows
        outside = (local < 0) | (local >= self.rows)
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_parallel(out.masked_fill(outside[..., None], 0.0), self.tp)


def gather(tensor: torch.Tensor, name: str, tp: TensorParallel) -> torch.Tensor:
    """The full tensor of parameter ``name`` (or of its optimizer state) from this rank's shard ``tensor``, on every
    rank of the TP group (collective); ``shard`` undoes it. Replicated tensors and scalars come back as they are."""
    dim = split_dim(name)
    if dim is None or not tp.enabled or tensor.dim() == 0:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def gather_state_dict(model: torch.nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of a tensor-parallel shard, on every rank of its group (collective)."""
    return {name: gather(value, name, tp) for name, value in model.state_dict().items()}


def clip_grad_norm(model: torch.nn.Module, max_norm: float, tp: TensorParallel, stages: Any = None) -> torch.Tensor:
    """Clip the gradients by the norm of the *whole* model's gradient, as if it were not sharded.

    Sharded gradients add up over the group; replicated ones (norm weights) are equal on every
    rank and count once. ``model`` may be one pipeline stage: ``stages`` (the pipeline's process group) adds up
    the stages' parts. Every rank gets the same norm, hence the same clip factor.
    """
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    sharded = [g for n, g in named if split_dim(n) is not None]
    replicated = [g for n, g in named if split_dim(n) is None]
    device = next(model.parameters()).device
    squares = torch.stack([torch.nn.utils.get_total_norm(gs) ** 2 if gs else torch.zeros((), device=device)
                           for gs in (sharded, replicated)])
    if tp.enabled:
        dist.all_reduce(squares[:1], group=tp.group)
    if stages is not None:
        dist.all_reduce(squares, group=stages)
    total = squares.sum().sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total)
    return total
