"""Reductions restricted to valid response tokens (``mask`` = 1), and per-sequence broadcasting."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when there are none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale the valid entries to zero mean and unit (unbiased) std; masked entries become 0."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    centered = (values - mean) * mask
    var = (centered**2).sum() / (mask.sum() - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Copy a per-sequence value ``[B]`` onto every valid token of its row, giving ``[B, T]``."""
    return per_sequence[:, None] * mask.to(per_sequence.dtype)


def token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last response token, zeros elsewhere."""
    last = (response_mask.long().cumsum(-1) == response_mask.sum(-1, keepdim=True)) & response_mask.bool()
    return last.float() * scores[:, None]
