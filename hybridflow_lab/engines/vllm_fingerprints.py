"""A vLLM model's weights fingerprinted under the checkpoint's (HF) names, whatever vLLM did to them: fused
(``qkv_proj``, ``gate_up_proj``, a mixture's experts stacked into ``w13``/``w2``), split over tensor-parallel ranks,
or held only in a repacked CPU kernel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridflow_lab.engines.weight_fingerprint import matrix_fingerprint, probe, tensor_fingerprint


def shard_fingerprints(model: nn.Module) -> tuple[dict[str, tuple[str, torch.Tensor]], set[str]]:
    """This rank's fingerprints of a vLLM model's weights under the checkpoint's (HF) names, each with how the
    TP ranks' parts combine (``rows`` concatenate, ``sum`` add up, ``whole`` is replicated), and the names whose
    matrix was only reachable through its kernel (the CPU backend drops linear weights after repacking them).

    Fused parameters (``qkv_proj``, ``gate_up_proj``) are split back into their members by output size, unless
    the checkpoint stores them fused too (Phi-3); stacked experts are split per expert (``expert_fingerprints``).
    """
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    values: dict[str, tuple[str, torch.Tensor]] = {}
    through_kernel: set[str] = set()
    for module_name, module in model.named_modules():
        if hasattr(module, "get_expert_mapping"):
            values.update((name, ("whole", part)) for name, part in expert_fingerprints(module_name, module).items())
            continue
        sharded = getattr(module, "tp_size", 1) > 1
        for param_name, param in module.named_parameters(recurse=False):
            split_columns = sharded and isinstance(module, RowParallelLinear) and param_name == "weight"
            kind = "sum" if split_columns else "rows" if sharded and isinstance(
                module, ColumnParallelLinear | VocabParallelEmbedding) else "whole"
            in_kernel = param.numel() == 0 and hasattr(module, "cpu_linear")
            if in_kernel or param.ndim == 2:
                columns = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None) \
                    or param.shape[1]
                offset = module.tp_rank * columns if split_columns else 0
                x = probe(module.input_size if split_columns else columns)[offset:offset + columns]
                if in_kernel:
                    fingerprint = module.cpu_linear(x.to(param.dtype)[None], param, None)[0].double()
                else:
                    fingerprint = matrix_fingerprint(param, x)
            else:
                fingerprint = tensor_fingerprint(param)
            prefix, _, leaf = module_name.rpartition(".")
            members = packed.get(leaf)
            if members and members != [leaf]:
                names = [f"{prefix}.{member}.{param_name}" for member in members]
                parts = fingerprint.cpu().split(list(module.output_partition_sizes))
            else:
                names, parts = [f"{module_name}.{param_name}"], [fingerprint.cpu()]
            values.update((name, (kind, part)) for name, part in zip(names, parts, strict=True))
            if in_kernel:
                through_kernel.update(names)
    return values, through_kernel


def expert_fingerprints(module_name: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """A mixture's experts (vLLM stacks them: ``w13_weight`` holds each expert's gate and up projections, ``w2_weight``
    its down projection) fingerprinted per expert under the checkpoint's names, from vLLM's own name mapping."""
    base = module_name[: module_name.rindex(".experts")]
    stacked = {"w13_": experts.w13_weight, "w2_": experts.w2_weight}
    values = {}
    for param_name, weight_name, expert, shard in experts.get_expert_mapping():
        matrix = stacked[param_name.rpartition(".")[2]][expert]
        if shard != "w2":  # w13 holds w1 (the gate) then w3 (up), each half of its rows
            matrix = matrix.chunk(2)[0 if shard == "w1" else 1]
        values[f"{base}.{weight_name}weight"] = matrix_fingerprint(matrix, probe(matrix.shape[1])).cpu()
    return values


def engine_fingerprints(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The whole model's fingerprints (``shard_fingerprints`` combined over vLLM's TP group; collective)."""
    from vllm.distributed import get_tp_group

    local, through_kernel = shard_fingerprints(model)
    group = get_tp_group()
    if group.world_size == 1:
        return {name: part for name, (_, part) in local.items()}, through_kernel
    shards: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(shards, local, group=group.cpu_group)
    combined = {}
    for name, (kind, part) in local.items():
        parts = [shard[name][1] for shard in shards]
        combined[name] = torch.cat(parts) if kind == "rows" else torch.stack(parts).sum(0) if kind == "sum" else part
    return combined, through_kernel
