"""Stage names: the steps of an RLHF iteration, shared by telemetry, metrics and dashboards."""

from enum import StrEnum


class Stage(StrEnum):
    NEXT_PROMPTS = "next_prompts"
    GENERATE = "generate"
    REWARD = "reward"
    SHAPE_REWARDS = "shape_rewards"
    OLD_LOG_PROB = "old_log_prob"
    REF = "ref"
    VALUES = "values"
    KL_PENALTY = "kl_penalty"
    ADV = "adv"
    UPDATE_CRITIC = "update_critic"
    UPDATE_ACTOR = "update_actor"
    GATHER_WEIGHTS = "gather_weights"  # the actor's full weights, for a rollout group of its own
    SYNC_WEIGHTS = "sync_weights"  # loaded into the rollout group
    EVALUATE = "evaluate"
    SAVE = "save"
