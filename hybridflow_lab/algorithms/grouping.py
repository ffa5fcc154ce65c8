"""Reductions over groups of sequences sampled from the same prompt (ids need not be contiguous)."""

from __future__ import annotations

import torch


def group_reduce(values: torch.Tensor, group_ids: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """Reduce ``values`` ``[B]`` within each group ("sum", "amax" or "amin"); every row gets its group's result."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    per_group = torch.zeros(len(unique), dtype=values.dtype, device=values.device)
    per_group = per_group.scatter_reduce(0, inverse, values, reduce=reduce, include_self=False)
    return per_group[inverse]


def group_sizes(group_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of rows in each row's group, ``[B]``."""
    return group_reduce(torch.ones(group_ids.shape, dtype=dtype, device=group_ids.device), group_ids)


def group_mean(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each row's group, ``[B]``."""
    return group_reduce(values, group_ids) / group_sizes(group_ids, values.dtype)


def group_centered(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``values`` minus their group's mean, exactly 0 in a group whose values are all equal.

    A computed mean of equal values need not equal them (64 rewards of 3.1 average to 3.1 plus rounding), and
    dividing that residue by a near-zero std would turn a group without signal into a large advantage.
    """
    constant = group_reduce(values, group_ids, "amax") == group_reduce(values, group_ids, "amin")
    centered = values - group_mean(values, group_ids)
    return torch.where(constant, torch.zeros_like(centered), centered)
