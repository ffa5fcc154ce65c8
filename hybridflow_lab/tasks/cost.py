"""Rule cost signals, for constrained RL (Safe-RLHF) on the bundled tasks."""

from __future__ import annotations


def digit_cost(prompt: str, response: str, ground_truth: str, forbidden: str = "7") -> float:
    """1.0 if ``response`` contains any character of ``forbidden``, else 0.0.

    Under the constraint "avoid the digit 7", answers that need a 7 cannot be both correct and
    safe, so Safe-RLHF has to trade reward for cost on them: the Lagrange multiplier decides how
    often the policy gives up the exact-match reward to keep the expected cost under its limit.
    """
    return float(any(char in response for char in forbidden))
