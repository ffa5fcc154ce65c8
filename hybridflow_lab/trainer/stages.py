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
    EVALUATE = "evaluate"
    SAVE = "save"
