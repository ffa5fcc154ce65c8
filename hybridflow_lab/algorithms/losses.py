"""Policy and value losses, returned as sums over response tokens (callers average).

Each function returns ``(loss_sum, metric_sums)``; the training engine divides both by the
number of tokens across all micro-batches and ranks, which makes the loss a global token mean.
"""

from __future__ import annotations

import torch


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
    mask = mask.float()
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    metrics = {
        "pg_clipfrac": ((clipped > unclipped).float() * mask).sum(),
        "ppo_kl": ((old_log_probs - log_probs) * mask).sum(),
    }
    return (loss * mask).sum(), metrics


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), PPO's clipped value loss."""
    mask = mask.float()
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    metrics = {"vf_clipfrac": (((clipped_values - returns) ** 2 > (values - returns) ** 2).float() * mask).sum()}
    return (loss * mask).sum(), metrics
