"""Advantage estimators: GAE (PPO), GRPO / Dr.GRPO, RLOO, ReMax, REINFORCE++ and its group baseline.

Token-level inputs are ``[B, T]`` over response tokens with ``mask`` marking the valid ones; sequence-level
``scores`` are ``[B]``. Every output is 0 at masked positions.
"""

from __future__ import annotations

import torch

from .grouping import group_centered, group_reduce, group_sizes
from .masked import broadcast_to_tokens, masked_whiten


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns ``(advantages, returns)`` with returns = raw advantages + values."""
    valid = mask.bool()
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    columns = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        # Masked positions carry the recursion through untouched, so padding never leaks into valid tokens.
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        columns.append(torch.where(valid[:, t], running, torch.zeros_like(running)))
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def grpo(
    scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantage: (score - group mean) / (group std + eps); Dr.GRPO when ``norm_by_std`` is False."""
    sizes = group_sizes(group_ids, scores.dtype)
    centered = group_centered(scores, group_ids)  # exactly 0 for a group of equal scores (singletons included)
    if norm_by_std:
        var = group_reduce(centered**2, group_ids) / (sizes - 1).clamp(min=1)
        centered = centered / (var.sqrt() + eps)
    return broadcast_to_tokens(centered, mask)


def rloo(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: score minus the mean of the other samples of its group (0 for singletons and
    groups of equal scores)."""
    sizes = group_sizes(group_ids, scores.dtype)
    # score - mean(others) = (score - mean(group)) * n / (n - 1)
    advantage = group_centered(scores, group_ids) * sizes / (sizes - 1).clamp(min=1)
    return broadcast_to_tokens(advantage, mask)


def remax(scores: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax: score minus the score of the greedy rollout of the same prompt (in ``scores``' dtype)."""
    return broadcast_to_tokens(scores - torch.as_tensor(baseline_scores, dtype=scores.dtype), mask)


def reinforce_plus_plus(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per valid token, whitened over the batch; ``(advantages, returns)``."""
    # the return-to-go is GAE's recursion with no critic (values 0) and lambda 1
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0, whiten=False)
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline: (score - group mean) on every token, whitened over the batch."""
    return masked_whiten(broadcast_to_tokens(group_centered(scores, group_ids), mask), mask)
