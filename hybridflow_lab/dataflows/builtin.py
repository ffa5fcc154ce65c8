"""The built-in algorithms: one short dataflow function each, read top to bottom, and their declarations.

A dataflow takes the stages (``lab``) and the step they record into, and hands back the step's final batch
and its metrics. Its responses come from ``lab.rollout()``: generated now, or ahead of training
(``rollout.max_staleness``). They differ in which stages run and in their advantage estimator; every decision is a line
here: where the KL to the reference enters (the rewards, ``kl_in_rewards``, or the actor's loss, inside
``update_actor`` with ``algorithm.kl_loss_coef``), where rewards are shaped (``scored``), which log-probs
are computed (``log_probs``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridflow_lab.algorithms.dapo import informative_groups
from hybridflow_lab.algorithms.safe_rlhf import combined_advantages
from hybridflow_lab.config import LabConfig
from hybridflow_lab.dataflows.algorithm import register_algorithm
from hybridflow_lab.dataflows.pending import Batch, resolve
from hybridflow_lab.dataflows.stages import Metrics, Stages, StepContext
from hybridflow_lab.protocol import DataBatch


def ppo(lab: Stages, step: StepContext) -> tuple[Batch, Metrics]:
    """PPO: a critic, GAE advantages, critic and actor updates (the paper's Figure 4)."""
    batch = scored(lab, lab.rollout())
    batch = log_probs(lab, batch)
    batch = lab.values(batch)
    batch = kl_in_rewards(lab, batch)
    batch = lab.advantages(batch)
    lab.update_critic(batch)
    lab.update_actor(batch)  # the clipped policy loss, + kl_loss_coef * KL to the reference when set
    return batch, step.metrics


def grpo(lab: Stages, step: StepContext) -> tuple[Batch, Metrics]:
    """GRPO (and Dr.GRPO, RLOO, REINFORCE++): outcome rewards compared within each prompt's group."""
    batch = sample(lab, step)
    batch = log_probs(lab, batch)
    batch = kl_in_rewards(lab, batch)
    batch = lab.advantages(batch)
    lab.update_actor(batch)  # the clipped policy loss, + kl_loss_coef * KL to the reference when set
    return batch, step.metrics


def remax(lab: Stages, step: StepContext) -> tuple[Batch, Metrics]:
    """ReMax: the baseline of each prompt is the reward of its greedy response (under the same policy, so its
    rollouts cannot run ahead)."""
    prompts = lab.next_prompts()
    batch = scored(lab, lab.generate(prompts))
    greedy = scored(lab, lab.generate(prompts, greedy=True, n=1))
    batch["baseline_scores"] = per_sample(greedy["scores"], greedy["uid"], batch["uid"])
    batch = log_probs(lab, batch)
    batch = kl_in_rewards(lab, batch)
    batch = lab.advantages(batch)
    lab.update_actor(batch)
    return batch, step.metrics


def safe_rlhf(lab: Stages, step: StepContext) -> tuple[Batch, Metrics]:
    """Safe-RLHF: maximise reward subject to expected cost <= limit, via a Lagrange multiplier."""
    batch = scored(lab, lab.rollout())  # scores and costs
    batch = log_probs(lab, batch)
    batch = kl_in_rewards(lab, batch)  # the KL leaves the rewards and joins the costs
    cost_advantages = lab.advantages(batch, scores="costs")["advantages"]
    batch = lab.advantages(batch)  # reward advantages
    multiplier = lab.lagrange.update(float(batch["costs"].mean()))
    batch["advantages"] = combined_advantages(batch["advantages"], cost_advantages, multiplier)
    lab.update_actor(batch)
    step.record({"safe/lagrange_multiplier": multiplier})
    return batch, step.metrics


def scored(lab: Stages, responses: Batch) -> Batch:
    """``responses`` with their ``scores``: the task's rule (or the reward model), then the run's reward shaping,
    DAPO's overlong penalty (``algorithm.overlong_buffer`` > 0)."""
    batch = lab.reward(responses)
    return lab.shape_rewards(batch) if lab.config.algorithm.overlong_buffer else batch


def log_probs(lab: Stages, batch: Batch) -> Batch:
    """The current policy's log-probs when the update needs them (several optimizer steps per batch), the
    reference's when the run needs them (a KL term)."""
    batch = lab.old_log_prob(batch) if lab.needs.old_log_probs else batch
    return lab.ref_log_prob(batch) if lab.needs.reference else batch


def kl_in_rewards(lab: Stages, batch: Batch) -> Batch:
    """The KL to the reference subtracted from the token rewards (PPO's way), when ``algorithm.kl_reward_coef`` > 0."""
    return lab.kl_penalty(batch) if lab.config.algorithm.kl_reward_coef > 0 else batch


def sample(lab: Stages, step: StepContext) -> Batch:
    """Generate and score; with DAPO's dynamic sampling, keep only groups whose rewards differ and
    draw more rollouts until a full batch is collected (or ``max_sampling_rounds`` is reached)."""
    if not lab.config.algorithm.dynamic_sampling:
        return scored(lab, lab.rollout())
    batch = informative_batch(lambda: resolve(scored(lab, lab.rollout())), lab.config)
    step.record({"dapo/kept_groups": len(set(batch["uid"].tolist()))})
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


register_algorithm("ppo", ppo, "gae", critic=True, asynchronous_rollout=True,
                   description="PPO with a critic and GAE")
register_algorithm("grpo", grpo, "grpo", group_relative=True, dynamic_sampling=True, asynchronous_rollout=True,
                   description="GRPO: the group's mean and standard deviation as the baseline")
register_algorithm("dr_grpo", grpo, "dr_grpo", group_relative=True, dynamic_sampling=True, asynchronous_rollout=True,
                   description="Dr. GRPO: the group's mean, no standard deviation, a constant loss normaliser")
register_algorithm("rloo", grpo, "rloo", group_relative=True, dynamic_sampling=True, asynchronous_rollout=True,
                   description="RLOO: the mean of the other samples of the prompt as the baseline")
register_algorithm("reinforce_plus_plus", grpo, "reinforce_plus_plus", dynamic_sampling=True,
                   asynchronous_rollout=True, description="REINFORCE++: discounted token returns, normalised over "
                   "the batch")
register_algorithm("reinforce_plus_plus_baseline", grpo, "reinforce_plus_plus_baseline", group_relative=True,
                   dynamic_sampling=True, asynchronous_rollout=True,
                   description="REINFORCE++ with the group's mean as the baseline")
register_algorithm("remax", remax, "remax", description="ReMax: the greedy response's reward as the baseline")
register_algorithm("safe_rlhf", safe_rlhf, "grpo", group_relative=True, cost=True, asynchronous_rollout=True,
                   description="Safe-RLHF: reward against a cost limit, with a Lagrange multiplier")
