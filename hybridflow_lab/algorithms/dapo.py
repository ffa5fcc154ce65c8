"""DAPO's dynamic-sampling filter and soft overlong-response penalty."""

from __future__ import annotations

import torch

from .grouping import group_reduce


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: True for rows whose group has at least two different scores (non-zero group advantage)."""
    return group_reduce(scores, group_ids, "amax") != group_reduce(scores, group_ids, "amin")


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """Per-sequence penalty ``[B]``: 0 up to ``max_length - buffer``, then linear down to ``-factor`` at max_length."""
    if buffer <= 0:
        raise ValueError(f"buffer must be positive, got {buffer}")
    overshoot = response_lengths.float() - (max_length - buffer)
    return -factor * (overshoot / buffer).clamp(0.0, 1.0)
