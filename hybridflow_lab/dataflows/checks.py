"""The one check of a whole run's config, before any worker starts: the algorithm, the rules between settings
(``config.rules``), then what the machine and the model files must offer (``preflight``)."""

from __future__ import annotations

import torch

from hybridflow_lab.algorithms.kl import kl_kind
from hybridflow_lab.algorithms.losses import aggregate
from hybridflow_lab.algorithms.registry import get_policy_loss
from hybridflow_lab.config import ConfigError, LabConfig, validate
from hybridflow_lab.dataflows.algorithm import ALGORITHMS, RunNeeds
from hybridflow_lab.dataflows.preflight import preflight


def check_config(config: LabConfig) -> RunNeeds:
    """Raise ``ConfigError`` for a setting that cannot work, before any worker starts; returns what the run needs."""
    needs = check_algorithm(config)
    check_rollout_group(config, needs)
    validate(config, roles=needs.trained_roles)
    preflight(config, roles=needs.trained_roles)
    return needs


def check_rollout_group(config: LabConfig, needs: RunNeeds) -> None:
    """A rollout group of its own, and generation running ahead of training, only where they can work."""
    rollout, name = config.rollout, config.algorithm.name
    if rollout.pool:
        taken = {getattr(config, role).pool: role for role in needs.trained_roles}
        if rollout.pool in taken:
            raise ConfigError("rollout.pool", f"pool {rollout.pool!r} holds the {taken[rollout.pool]}; a rollout group "
                              "gets a pool of its own (e.g. rollout.pool=rollout), or leave rollout.pool empty for "
                              "the actor's ranks to generate (the hybrid engine)")
        if rollout.tensor_parallel > 1:
            raise ConfigError("rollout.tensor_parallel", "a rollout group of its own runs data parallel, each rank "
                              "with the whole policy; set rollout.tensor_parallel=1, or leave rollout.pool empty")
    if rollout.max_staleness <= 0:  # on-policy (a negative value fails its bound in config.bounds)
        return
    if not needs.algorithm.asynchronous_rollout:
        able = sorted(n for n, a in ALGORITHMS.items() if a.asynchronous_rollout)
        raise ConfigError("rollout.max_staleness", f"the {name} dataflow cannot take batches from an older policy "
                          f"(it does not draw them with lab.rollout(), or its update cannot weight them); set "
                          f"rollout.max_staleness=0, or use one that can: {', '.join(able)}")
    if not rollout.pool:
        raise ConfigError("rollout.max_staleness", "generation colocated with training (the actor's ranks, "
                          "rollout.pool empty) waits for each update, so it cannot run ahead; give it a pool of its "
                          "own: rollout.pool=rollout, or set rollout.max_staleness=0")
    if config.backend != "ray" or not config.trainer.overlap:
        key = "backend" if config.backend != "ray" else "trainer.overlap"
        raise ConfigError(key, "generation runs ahead of training only when stages overlap on Ray; set backend=ray "
                          "and trainer.overlap=true, or rollout.max_staleness=0")


def check_algorithm(config: LabConfig) -> RunNeeds:
    """Reject algorithm settings that cannot run; returns what the run needs."""
    algorithm = config.algorithm
    if algorithm.name not in ALGORITHMS:
        raise ConfigError("algorithm.name", f"{algorithm.name!r} is not one of {sorted(ALGORITHMS)}; a notebook "
                          "declares its own with hybridflow_lab.dataflows.register_algorithm")
    needs = RunNeeds.of(config)
    declared = needs.algorithm
    checks = {
        "algorithm.policy_loss": lambda: get_policy_loss(algorithm.policy_loss),
        "algorithm.kl_loss_kind": lambda: kl_kind(algorithm.kl_loss_kind),
        "algorithm.kl_reward_kind": lambda: kl_kind(algorithm.kl_reward_kind),
        "algorithm.loss_agg": lambda: algorithm.loss_agg == "auto" or aggregate(
            torch.zeros(1, 1), torch.ones(1, 1), algorithm.loss_agg, config.rollout.max_new_tokens),
    }
    for key, check in checks.items():
        try:
            check()
        except (KeyError, ValueError) as exc:
            raise ConfigError(key, str(exc.args[0] if exc.args else exc)) from None
    if algorithm.kl_target > 0 and algorithm.kl_reward_coef == 0:
        raise ConfigError("algorithm.kl_target", "the adaptive controller steers the coefficient of the KL penalty "
                          "in the rewards, which is off (algorithm.kl_reward_coef=0); set algorithm.kl_reward_coef "
                          "> 0 (its starting value, e.g. 0.05), or algorithm.kl_target=0")
    if declared.cost and not config.task.cost:
        raise ConfigError("task.cost", f"{declared.name} needs a cost signal; set task.cost (e.g. digit_cost)")
    if declared.reward_model and not config.reward_model_path:
        raise ConfigError("reward_model_path", f"{declared.name} scores with a learned reward model; set "
                          "reward_model_path to its directory")
    if declared.group_relative and config.batch.samples_per_prompt < 2:
        raise ConfigError("batch.samples_per_prompt", f"{declared.name} scores each sample against the other "
                          "samples of its prompt, and a group of one has none (every advantage would be 0); set "
                          "batch.samples_per_prompt >= 2 (e.g. 8)")
    if algorithm.dynamic_sampling:
        _check_dynamic_sampling(config, needs)
    return needs


def _check_dynamic_sampling(config: LabConfig, needs: RunNeeds) -> None:
    name = config.algorithm.name
    if not needs.algorithm.dynamic_sampling:
        supported = sorted(n for n, a in ALGORITHMS.items() if a.dynamic_sampling)
        raise ConfigError("algorithm.dynamic_sampling", f"the {name} dataflow does not filter groups (these do: "
                          f"{', '.join(supported)}); set algorithm.dynamic_sampling=false or choose one of those")
    if config.batch.samples_per_prompt < 2:
        raise ConfigError("batch.samples_per_prompt", "dynamic sampling keeps only groups whose samples got "
                          "different rewards, and a group of one sample never has two; set "
                          "batch.samples_per_prompt >= 2 (e.g. 4), or algorithm.dynamic_sampling=false")
