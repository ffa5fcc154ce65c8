"""One short function per algorithm: the dataflow of one RL iteration, read top to bottom.

Each takes the ``Lab`` (whose stage methods move batches between worker groups) and returns
the step's final batch. Compare them side by side: they differ in which stages run and in
the advantage estimator, nothing else. A user's own dataflow is a function of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow_lab.algorithms.dapo import informative_groups
from hybridflow_lab.algorithms.safe_rlhf import combined_advantages
from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.protocol import DataBatch

if TYPE_CHECKING:
    from hybridflow_lab.trainer.lab import Lab


def ppo(lab: Lab) -> DataBatch:
    """PPO: a critic, GAE advantages, critic and actor updates (the paper's Figure 4)."""
    batch = lab.reward(lab.generate(lab.next_prompts()))
    batch = log_probs(lab, batch)
    batch = lab.advantages(lab.values(batch))
    lab.update_critic(batch)
    lab.update_actor(batch)
    return batch


def grpo(lab: Lab) -> DataBatch:
    """GRPO (and Dr.GRPO, RLOO, REINFORCE++): outcome rewards normalised within each prompt's group."""
    batch = sample(lab)
    batch = log_probs(lab, batch)
    batch = lab.advantages(batch)
    lab.update_actor(batch)
    return batch


def remax(lab: Lab) -> DataBatch:
    """ReMax: the baseline of each prompt is the reward of its greedy response."""
    prompts = lab.next_prompts()
    batch = lab.reward(lab.generate(prompts))
    greedy = lab.reward(lab.generate(prompts, greedy=True, n=1))
    batch["baseline_scores"] = per_sample(greedy["scores"], greedy["uid"], batch["uid"])
    batch = log_probs(lab, batch)
    batch = lab.advantages(batch)
    lab.update_actor(batch)
    return batch


def safe_rlhf(lab: Lab) -> DataBatch:
    """Safe-RLHF: maximise reward subject to expected cost <= limit, via a Lagrange multiplier."""
    batch = lab.reward(lab.generate(lab.next_prompts()))  # scores and costs
    batch = log_probs(lab, batch)
    cost_advantages = lab.advantages(batch, scores="costs")["advantages"]
    batch = lab.advantages(batch)  # reward advantages
    multiplier = lab.lagrange.update(float(batch["costs"].mean()))
    batch["advantages"] = combined_advantages(batch["advantages"], cost_advantages, multiplier)
    lab.update_actor(batch)
    lab.record({"safe/lagrange_multiplier": multiplier})
    return batch


def log_probs(lab: Lab, batch: DataBatch) -> DataBatch:
    """The current policy's log-probs when the update needs them, the reference's when a KL term is configured."""
    batch = lab.old_log_prob(batch) if lab.needs_old_log_probs else batch
    return lab.ref_log_prob(batch) if lab.uses_reference else batch


def sample(lab: Lab) -> DataBatch:
    """Generate and score; with DAPO's dynamic sampling, keep only groups whose rewards differ and
    draw more prompts until a full batch is collected (or ``max_sampling_rounds`` is reached)."""
    def draw() -> DataBatch:
        return lab.reward(lab.generate(lab.next_prompts()))

    if not lab.config.algorithm.dynamic_sampling:
        return draw()
    batch = informative_batch(draw, lab.config)
    lab.record({"dapo/kept_groups": len(set(batch["uid"].tolist()))})
    return batch


def informative_batch(draw: Callable[[], DataBatch], config: LabConfig) -> DataBatch:
    """Up to ``rollout_batch_prompts`` groups whose rewards differ, from at most ``max_sampling_rounds`` scored
    batches (with ``uid`` and ``scores``) returned by ``draw``; an error naming the settings to change when
    every group's samples got equal rewards."""
    rounds, wanted = config.algorithm.max_sampling_rounds, config.batch.rollout_batch_prompts
    kept = _informative_rows(draw())
    for _ in range(rounds - 1):
        if len(set(kept["uid"].tolist())) >= wanted:
            break
        kept = DataBatch.concat([kept, _informative_rows(draw())])
    if len(kept) == 0:
        samples = config.batch.samples_per_prompt
        raise RuntimeError(f"dynamic sampling kept no group in {rounds} rounds: in every group all {samples} "
                           "samples got the same reward, so no group has a learning signal; raise "
                           f"algorithm.max_sampling_rounds (now {rounds}) or batch.samples_per_prompt (now {samples}), "
                           "or set algorithm.dynamic_sampling=false")
    uids = sorted(set(kept["uid"].tolist()))[:wanted]
    return kept[np.isin(kept["uid"], uids)]


def per_sample(per_prompt: torch.Tensor, prompt_uids: np.ndarray, sample_uids: np.ndarray) -> torch.Tensor:
    """Each sample's entry of ``per_prompt`` (one value per prompt uid), in ``per_prompt``'s dtype."""
    row_of = {uid: row for row, uid in enumerate(prompt_uids.tolist())}
    return per_prompt[torch.tensor([row_of[uid] for uid in sample_uids.tolist()], dtype=torch.long)]


def _informative_rows(batch: DataBatch) -> DataBatch:
    return batch[informative_groups(batch["scores"], _group_ids(batch)).numpy()]


def _group_ids(batch: DataBatch) -> torch.Tensor:
    return torch.as_tensor(batch["uid"].astype(np.int64))


Dataflow = Callable[["Lab"], DataBatch]

DATAFLOWS: dict[str, Dataflow] = {
    "ppo": ppo, "grpo": grpo, "dr_grpo": grpo, "rloo": grpo, "reinforce_plus_plus": grpo,
    "reinforce_plus_plus_baseline": grpo, "remax": remax, "safe_rlhf": safe_rlhf,
}
ESTIMATOR_OF: dict[str, str] = {
    "ppo": "gae", "grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "remax": "remax", "safe_rlhf": "grpo",
}

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")  # a sample against its group


def register_dataflow(name: str, dataflow: Dataflow, estimator: str) -> None:
    """Make ``algorithm.name=<name>`` run ``dataflow`` with advantage estimator ``estimator``."""
    DATAFLOWS[name], ESTIMATOR_OF[name] = dataflow, estimator


def uses_critic(config: LabConfig) -> bool:
    return ESTIMATOR_OF.get(config.algorithm.name) == "gae"


def check_algorithm(config: LabConfig) -> None:
    """Reject algorithm settings that cannot run, before any worker starts."""
    from hybridflow_lab.algorithms.kl import kl_kind
    from hybridflow_lab.algorithms.losses import aggregate
    from hybridflow_lab.algorithms.registry import get_advantage_estimator, get_policy_loss

    algorithm = config.algorithm
    if algorithm.name not in DATAFLOWS:
        raise ConfigError("algorithm.name", f"{algorithm.name!r} is not one of {sorted(DATAFLOWS)}")
    checks = {
        "algorithm.policy_loss": lambda: get_policy_loss(algorithm.policy_loss),
        "algorithm.kl_loss_kind": lambda: kl_kind(algorithm.kl_loss_kind),
        "algorithm.kl_reward_kind": lambda: kl_kind(algorithm.kl_reward_kind),
        "algorithm.loss_agg": lambda: algorithm.loss_agg == "auto" or aggregate(
            torch.zeros(1, 1), torch.ones(1, 1), algorithm.loss_agg, config.rollout.max_new_tokens),
        "algorithm.name ": lambda: get_advantage_estimator(ESTIMATOR_OF[algorithm.name]),
    }
    for key, check in checks.items():
        try:
            check()
        except (KeyError, ValueError) as exc:
            raise ConfigError(key.strip(), str(exc.args[0] if exc.args else exc)) from None
    if algorithm.kl_target > 0 and algorithm.kl_reward_coef == 0:
        raise ConfigError("algorithm.kl_target", "the adaptive controller steers the coefficient of the KL penalty "
                          "in the rewards, which is off (algorithm.kl_reward_coef=0); set algorithm.kl_reward_coef "
                          "> 0 (its starting value, e.g. 0.05), or algorithm.kl_target=0")
    if algorithm.name == "safe_rlhf" and not config.task.cost:
        raise ConfigError("task.cost", "safe_rlhf needs a cost signal; set task.cost (e.g. digit_cost)")
    if ESTIMATOR_OF[algorithm.name] in GROUP_ESTIMATORS and config.batch.samples_per_prompt < 2:
        raise ConfigError("batch.samples_per_prompt", f"{algorithm.name} scores each sample against the other "
                          "samples of its prompt, and a group of one has none (every advantage would be 0); set "
                          "batch.samples_per_prompt >= 2 (e.g. 8)")
    if algorithm.dynamic_sampling:
        _check_dynamic_sampling(config)


def _check_dynamic_sampling(config: LabConfig) -> None:
    name = config.algorithm.name
    if DATAFLOWS[name] in (ppo, remax, safe_rlhf):
        raise ConfigError("algorithm.dynamic_sampling", f"the {name} dataflow does not filter groups (the grpo "
                          "dataflow does, for grpo, dr_grpo, rloo and the reinforce_plus_plus variants); set "
                          "algorithm.dynamic_sampling=false or choose one of those")
    if config.batch.samples_per_prompt < 2:
        raise ConfigError("batch.samples_per_prompt", "dynamic sampling keeps only groups whose samples got "
                          "different rewards, and a group of one sample never has two; set "
                          "batch.samples_per_prompt >= 2 (e.g. 4), or algorithm.dynamic_sampling=false")
