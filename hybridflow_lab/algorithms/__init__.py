"""RLHF algorithms as pure torch functions: advantages, KL, losses, rollout correction, Safe-RLHF, DAPO, and
their registries.

This package imports only torch, numpy and the standard library, so it can be used and tested on its own.
"""

from .advantages import gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo
from .dapo import informative_groups, overlong_penalty
from .grouping import group_centered, group_mean, group_reduce, group_sizes
from .kl import KL_ALIASES, KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_estimate, kl_kind
from .losses import (
    AGGREGATION_MODES,
    aggregate,
    cispo_policy_loss,
    clipped_value_loss,
    gspo_policy_loss,
    importance_ratio,
    ppo_policy_loss,
)
from .masked import broadcast_to_tokens, masked_mean, masked_whiten
from .registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from .rollout_correction import rollout_correction
from .safe_rlhf import LagrangeMultiplier, combined_advantages

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ALIASES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "LagrangeMultiplier",
    "aggregate",
    "apply_kl_penalty",
    "broadcast_to_tokens",
    "cispo_policy_loss",
    "clipped_value_loss",
    "combined_advantages",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_centered",
    "group_mean",
    "group_reduce",
    "group_sizes",
    "grpo",
    "gspo_policy_loss",
    "importance_ratio",
    "informative_groups",
    "kl_estimate",
    "kl_kind",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "rollout_correction",
]
