"""The controller's state between steps, besides the models: what a checkpoint stores for the run to go on."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from hybridflow_lab.algorithms.kl import AdaptiveKLController, FixedKLController
from hybridflow_lab.algorithms.safe_rlhf import LagrangeMultiplier
from hybridflow_lab.config import LabConfig


@dataclass
class RunState:
    """The step counter, the policy version (actor updates so far: each generated row's ``policy_version`` says
    which one generated it) and the KL and Lagrange controllers."""

    step_index: int
    policy_version: int
    kl: AdaptiveKLController | FixedKLController
    lagrange: LagrangeMultiplier

    @classmethod
    def fresh(cls, config: LabConfig) -> RunState:
        """The state at step 0 under ``config``'s algorithm settings."""
        algorithm = config.algorithm
        kl = AdaptiveKLController(algorithm.kl_reward_coef, algorithm.kl_target, algorithm.kl_horizon) \
            if algorithm.kl_target > 0 else FixedKLController(algorithm.kl_reward_coef)
        return cls(0, 0, kl, LagrangeMultiplier(algorithm.lagrange_init, algorithm.lagrange_lr, algorithm.cost_limit))

    def copy(self) -> RunState:
        """An independent copy: a replay updates its own controllers, never the run's."""
        return copy.deepcopy(self)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_index, "policy_version": self.policy_version, "kl": self.kl.state_dict(),
                "lagrange": self.lagrange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = state["step"]
        self.policy_version = state.get("policy_version", self.step_index)
        self.kl.load_state_dict(state["kl"])
        self.lagrange.load_state_dict(state["lagrange"])
