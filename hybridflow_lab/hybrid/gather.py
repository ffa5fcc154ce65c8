"""Where the actor's generation weights come from: the process groups of a transition and the buffers it fills.

A transition gathers in two steps:

1. **Inside the stage**: each of this stage's TP-split weights is all-gathered among the ranks of this stage
   that hold its generation rows: for ``hybridflow`` the micro-DP group's ranks of this stage (``t / tg``
   consecutive ranks; without stages, the whole micro-DP group), for the baselines the training TP group.
2. **Across stages** (``p > 1``): every stage's gathered weights are broadcast over the pipeline group (the
   ranks of this tensor shard and replica, one per stage) from the rank of that stage, which holds exactly
   the rows this rank needs; replicated weights (norms) of each stage the same way.

Each stage's gathered weights are one flat buffer, a weight's rows (its TP split dimension) a contiguous view
of it, so step 2 is one broadcast per stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_lab.controller.mesh import PP, TP
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.pipeline import DecoderStage


def all_gather_rows(output: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
    """Start gathering every rank's ``shard`` into ``output`` in rank order along dim 0; returns the pending work.

    torch 2.13 names this collective ``all_gather_single`` and deprecates ``all_gather_into_tensor``; torch 2.11,
    the lent GPU machines' torch, has only the older name.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=True)


@dataclass(frozen=True)
class Groups:
    """The process groups a strategy needs, each containing this rank (None where unused)."""

    micro_dp: Any = None
    micro_dp_stage: Any = None  # the micro-DP group's ranks on this rank's training stage
    training_tp: Any = None
    generation_tp: Any = None
    pipeline: Any = None  # the training pipeline group; None without stages
    world: Any = None


def process_groups(device_mesh: Any) -> Groups:
    """The groups of ``ParallelLayout.meshes()``, from a worker's ``device_mesh(name)`` accessor (collective)."""
    train, regroup, generate = device_mesh("train"), device_mesh("regroup"), device_mesh("generate")
    staged = PP in train.mesh_dim_names
    micro_dp = regroup.get_group("micro_dp")
    return Groups(micro_dp=micro_dp, micro_dp_stage=micro_dp_stage_group(train, regroup, generate) if staged
                  else micro_dp, training_tp=train.get_group(TP), generation_tp=generate.get_group(TP),
                  pipeline=train.get_group(PP) if staged else None, world=dist.group.WORLD)


def micro_dp_stage_group(train: Any, regroup: Any, generate: Any) -> Any:
    """This rank's micro-DP group's ranks on its own training stage: blocks of ``dg / (p / pg)`` (``t / tg``)
    consecutive ranks, as ``ParallelLayout.rank`` numbers them. Every rank creates every block's group, in order."""
    def size(mesh: Any, axis: str) -> int:
        return mesh.size(mesh.mesh_dim_names.index(axis)) if axis in mesh.mesh_dim_names else 1

    block = size(regroup, "micro_dp") // (size(train, PP) // size(generate, PP))
    groups = [dist.new_group(list(range(start, start + block))) for start in range(0, dist.get_world_size(), block)]
    return groups[dist.get_rank() // block]


def owner_stages(model: DecoderLM, stages: int) -> dict[str, int]:
    """The training stage holding each parameter of ``model`` (``DecoderStage``'s split), in the model's order."""
    stage_of = {name: index for index in range(stages)
                for name, _ in DecoderStage(model, index, stages).named_parameters()}
    return {name: stage_of[name] for name, _ in model.named_parameters()}


def stage_buffers(rows: dict[str, tuple[int, ...]], stages: dict[str, int], count: int, like: torch.Tensor
                  ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One flat buffer per stage (``count``) holding its weights' ``rows`` back to back, and each weight's view."""
    sizes = [0] * count
    offsets = {}
    for name, shape in rows.items():
        offsets[name] = sizes[stages[name]]
        sizes[stages[name]] += torch.Size(shape).numel()
    flats = [torch.empty(size, dtype=like.dtype, device=like.device) for size in sizes]
    views = {name: flats[stages[name]][offsets[name]:offsets[name] + torch.Size(shape).numel()].view(shape)
             for name, shape in rows.items()}
    return flats, views
