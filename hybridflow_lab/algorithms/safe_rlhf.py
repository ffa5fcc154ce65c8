"""Safe-RLHF: a Lagrange multiplier trading reward against a cost constraint, and the combined advantage."""

from __future__ import annotations

import torch


class LagrangeMultiplier:
    """lambda >= 0, moved by projected gradient ascent on (mean cost - cost limit), optionally capped."""

    def __init__(self, init: float = 1.0, lr: float = 0.05, cost_limit: float = 0.0, max_value: float | None = None):
        self.value = float(init)
        self.lr = lr
        self.cost_limit = cost_limit
        self.max_value = max_value

    def update(self, mean_cost: float) -> float:
        """One ascent step on the constraint violation; returns the new lambda."""
        value = max(0.0, self.value + self.lr * (mean_cost - self.cost_limit))
        if self.max_value is not None:
            value = min(value, self.max_value)
        self.value = value
        return value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def combined_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, lagrange: float
) -> torch.Tensor:
    """(A_reward - lambda * A_cost) / (1 + lambda), Safe-RLHF's normalised combination."""
    return (reward_advantages - lagrange * cost_advantages) / (1.0 + lagrange)
