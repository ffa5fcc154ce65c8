"""Correcting the policy gradient for the gap between the rollout engine's and the trainer's log-probs.

The rollout engine (vLLM in bf16, other kernels, top-k/top-p sampling, a stale policy version) samples from a
distribution ``pi_rollout`` that differs from the trainer's ``pi_train``. Importance weights
``pi_train / pi_rollout``, computed per token or per sequence (the product over its tokens), either multiply
the policy loss capped at ``cap`` (truncated importance sampling, TIS) or drop the tokens and sequences whose
weight leaves ``[low, high]`` (masked importance sampling, MIS / IcePop).
"""

from __future__ import annotations

import torch

from .kl import clamped_exp

LEVELS = ("", "token", "sequence")  # "" turns the correction off


def is_level(setting: str, stale: bool, mask_level: str) -> str:
    """The TIS level a run uses for ``algorithm.rollout_is=setting``: ``"auto"`` is ``"token"`` when its batches
    come from an older policy version (``stale``, asynchronous rollout) and no masked IS is set, else off."""
    if setting != "auto":
        return setting
    return "token" if stale and not mask_level else ""


def rollout_correction(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    is_level: str = "",
    is_cap: float = 2.0,
    mask_level: str = "",
    mask_low: float = 0.5,
    mask_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached per-token weights ``[B, T]`` for the policy loss (1 with both corrections off, 0 at masked
    positions) and per-token metrics: ``mismatch`` (|log p_train - log p_rollout|), ``is_weight``, and the
    tokens ``is_capped`` by TIS or ``is_masked`` by MIS."""
    for name, level in (("is_level", is_level), ("mask_level", mask_level)):
        if level not in LEVELS:
            raise ValueError(f"{name} must be one of {LEVELS}, got {level!r}")
    mask = mask.to(train_log_probs.dtype)
    log_ratio = ((train_log_probs - rollout_log_probs) * mask).detach()

    def ratio(level: str) -> torch.Tensor:
        return clamped_exp(log_ratio if level == "token" else log_ratio.sum(-1, keepdim=True).expand_as(log_ratio))

    weights = torch.ones_like(log_ratio)
    capped = masked = torch.zeros_like(log_ratio, dtype=torch.bool)
    if is_level:
        weights = ratio(is_level)
        capped = weights > is_cap
        weights = weights.clamp(max=is_cap)
    if mask_level:
        level_ratio = ratio(mask_level)
        masked = (level_ratio < mask_low) | (level_ratio > mask_high)
        weights = torch.where(masked, torch.zeros_like(weights), weights)
    weights = weights * mask
    metrics = {"mismatch": log_ratio.abs(), "is_weight": weights, "is_capped": capped.to(mask.dtype) * mask,
               "is_masked": masked.to(mask.dtype) * mask}
    return weights, metrics
