"""KL estimators between the policy and the reference, the KL reward penalty, and KL coefficient controllers."""

from __future__ import annotations

import torch

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's names for the same estimators
KL_KINDS = ("k1", "k2", "k3", "abs")
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-20 before exp: exp(20) is finite, exp(100) * 0 is NaN


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log-ratio clamped to ``+-MAX_LOG_RATIO`` first, so the ratio and its gradient stay finite."""
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def kl_kind(name: str) -> str:
    """The project's name of a KL estimator given by its own name or verl's (``low_var_kl`` -> ``k3``)."""
    kind = KL_ALIASES.get(name, name)
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {name!r}; known: {', '.join(KL_KINDS)} "
                         f"(or verl's {', '.join(f'{a}={k}' for a, k in KL_ALIASES.items())})")
    return kind


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs; ``kind`` in ``KL_KINDS``
    (or a verl alias)."""
    kind = kl_kind(kind)
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "abs":
        return log_ratio.abs()
    # k3: Schulman's unbiased, always non-negative estimator. Clamping the log-ratio before exp keeps both the
    # value and its gradient finite (a clamp after exp would still give exp(100) * 0 = NaN in the backward pass).
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10.0, 10.0)


def apply_kl_penalty(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, float]:
    """Token rewards = scores - coef * KL on valid tokens; also the batch mean of per-sequence mean KLs.

    A negative ``coef`` adds the KL instead (Safe-RLHF's cost side, which the KL makes costlier).
    """
    valid = mask.bool()
    kl = torch.where(valid, kl_estimate(log_probs, ref_log_probs, kind), torch.zeros_like(log_probs))
    token_rewards = torch.where(valid, token_scores - coef * kl, torch.zeros_like(kl))
    lengths = valid.sum(dim=1)
    nonempty = lengths > 0
    per_sequence = kl.sum(dim=1)[nonempty] / lengths[nonempty]
    mean_kl = per_sequence.mean().item() if per_sequence.numel() else 0.0
    return token_rewards, mean_kl


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.'s proportional controller steering the observed KL towards ``target``."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        super().__init__(init_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by 1 + clip(kl / target - 1, +-0.2) * n_steps / horizon."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
