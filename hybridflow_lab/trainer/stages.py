"""Stage names: the steps of an RLHF iteration, shared by telemetry, metrics and dashboards."""

from enum import StrEnum

from hybridflow_lab.trainer.scheduler import CONTROLLER_LANE


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


STAGE_MODELS = {  # the model each stage runs (the rows of the dataflow graph); the rest are the controller's
    Stage.GENERATE: "rollout", Stage.SYNC_WEIGHTS: "rollout", Stage.OLD_LOG_PROB: "actor", Stage.UPDATE_ACTOR: "actor",
    Stage.GATHER_WEIGHTS: "actor", Stage.REF: "reference", Stage.VALUES: "critic", Stage.UPDATE_CRITIC: "critic",
}


def model_of(stage: Stage, pool: str) -> str:
    """The model ``stage`` runs on pool lane ``pool``: the reward is a reward model's on a pool, else a function."""
    if stage is Stage.REWARD:
        return "reward function" if pool == CONTROLLER_LANE else "reward model"
    return STAGE_MODELS.get(stage, "controller")
