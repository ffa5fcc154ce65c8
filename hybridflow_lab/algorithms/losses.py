"""Token-level policy and value losses, and their aggregation into sums that add up across micro-batches.

Losses return ``[B, T]`` tensors (0 at masked positions) plus ``[B, T]`` metric tensors; ``aggregate`` turns a
loss into ``(loss_sum, units)``. Callers add both over all micro-batches and data-parallel ranks, then divide
once, so the result is the chosen mode's mean over the whole batch whatever the split.
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with separate low/high ranges (DAPO's clip-higher) and optional dual clip."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = mask.to(log_probs.dtype)
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    metrics = {
        "pg_clipfrac": (clipped > unclipped).to(mask.dtype) * mask,
        "ppo_kl": (old_log_probs - log_probs).detach() * mask,
    }
    return loss * mask, metrics


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2), PPO's clipped value loss."""
    mask = mask.to(values.dtype)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    return loss * mask, {"vf_clipfrac": (clipped_error > unclipped_error).to(mask.dtype) * mask}


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, float]:
    """Reduce a ``[B, T]`` loss to ``(loss_sum, units)``; ``loss_sum / units`` is the mode's mean."""
    mask = mask.to(loss.dtype)
    token_sums = (loss * mask).sum(dim=1)
    lengths = mask.sum(dim=1)
    if mode == "token-mean":
        return token_sums.sum(), float(lengths.sum().item())
    sequences = float((lengths > 0).sum().item())
    if mode == "seq-mean-token-sum":
        return token_sums.sum(), sequences
    if mode == "seq-mean-token-mean":
        return (token_sums / lengths.clamp(min=1)).sum(), sequences
    raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {', '.join(AGGREGATION_MODES)}")
