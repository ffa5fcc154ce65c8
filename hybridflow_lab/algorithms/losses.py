"""Token-level policy and value losses, and their aggregation into sums that add up across micro-batches.

Losses return ``[B, T]`` tensors (0 at masked positions) plus ``[B, T]`` metric tensors; ``aggregate`` turns a
loss into ``(loss_sum, units)``. Callers add both over all micro-batches and data-parallel ranks, then divide
once, so the result is the chosen mode's mean over the whole batch whatever the split.

Every importance ratio is ``kl.clamped_exp`` of its log-ratio (clamped to +-20 first): a ratio of ``exp(100)``
times an advantage of exactly 0 (a padding token, a group of equal rewards) would otherwise be NaN.
"""

from __future__ import annotations

import torch

from .kl import clamped_exp

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def importance_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(log_probs - old_log_probs)`` with the log-ratio clamped, so ratio and gradient stay finite."""
    return clamped_exp(log_probs - old_log_probs)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clip won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def policy_metrics(clipped: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every policy loss's per-token metrics: where its clip acted, and the approximate KL to the old policy."""
    return {"pg_clipfrac": clipped.to(mask.dtype) * mask, "ppo_kl": (old_log_probs - log_probs).detach() * mask}


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with separate low/high ranges (DAPO's clip-higher) and optional dual clip."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = mask.to(log_probs.dtype)
    loss, was_clipped = clipped_surrogate(importance_ratio(log_probs, old_log_probs), advantages, clip_low, clip_high)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss * mask, policy_metrics(was_clipped, log_probs, old_log_probs, mask)


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO's clip on the sequence's length-normalised ratio
    ``s = exp(mean_t log(pi / pi_old))`` with its own, much narrower range (the paper's 3e-4 / 4e-4).

    Each token carries ``s`` as its value and its own ``log pi`` as its gradient path (GSPO-token:
    ``sg[s] * pi_t / sg[pi_t]``), so with one advantage per sequence the gradient is the paper's.
    """
    mask = mask.to(log_probs.dtype)
    lengths = mask.sum(-1).clamp(min=1)
    sequence_log_ratio = ((log_probs - old_log_probs) * mask).sum(-1) / lengths
    token_log_ratio = log_probs - log_probs.detach() + sequence_log_ratio.detach()[:, None]
    loss, was_clipped = clipped_surrogate(clamped_exp(token_log_ratio), advantages, gspo_clip_low, gspo_clip_high)
    return loss * mask, policy_metrics(was_clipped, log_probs, old_log_probs, mask)


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cispo_clip_low: float = 1.0,
    cispo_clip_high: float = 4.0,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the importance ratio clipped to
    ``[1 - low, 1 + high]`` under a stop-gradient, ``-sg(clip(r)) * A * log pi``; unlike PPO's clip, a clipped
    token keeps its gradient. The defaults (no lower bound, upper bound 5) are ScaleRL's."""
    mask = mask.to(log_probs.dtype)
    ratio = importance_ratio(log_probs, old_log_probs).detach()
    weight = torch.clamp(ratio, 1 - cispo_clip_low, 1 + cispo_clip_high)
    return -weight * advantages * log_probs * mask, policy_metrics(weight != ratio, log_probs, old_log_probs, mask)


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


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_tokens: int = 0) -> tuple[torch.Tensor, float]:
    """Reduce a ``[B, T]`` loss to ``(loss_sum, units)``; ``loss_sum / units`` is the mode's mean.

    ``seq-mean-token-sum-norm`` (Dr. GRPO) divides each sequence's token sum by the constant ``norm_tokens``
    (the generation budget) instead of its length, so no sequence's tokens weigh more for being short.
    """
    mask = mask.to(loss.dtype)
    token_sums = (loss * mask).sum(dim=1)
    units = loss_units(mask, mode, norm_tokens)
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(dim=1).clamp(min=1)).sum(), units
    return token_sums.sum(), units


def loss_units(mask: torch.Tensor, mode: str, norm_tokens: int = 0) -> float:
    """What ``aggregate`` divides a loss sum by under ``mode``: the valid tokens of ``mask``, its sequences, or (Dr.
    GRPO) its sequences times ``norm_tokens``."""
    lengths = mask.sum(dim=1)
    if mode == "token-mean":
        return float(lengths.sum().item())
    sequences = float((lengths > 0).sum().item())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return sequences
    if mode == "seq-mean-token-sum-norm":
        if norm_tokens < 1:
            raise ValueError(f"{mode} divides by a constant token count; pass norm_tokens >= 1, got {norm_tokens}")
        return sequences * norm_tokens
    raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {', '.join(AGGREGATION_MODES)}")
