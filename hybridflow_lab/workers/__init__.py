"""The RLHF roles as worker classes; each public method is one registered call."""

from hybridflow_lab.workers.actor import ActorWorker
from hybridflow_lab.workers.critic import CriticWorker
from hybridflow_lab.workers.reward import RewardModelWorker, RuleRewardWorker, rule_scores

__all__ = ["ActorWorker", "CriticWorker", "RewardModelWorker", "RuleRewardWorker", "rule_scores"]
