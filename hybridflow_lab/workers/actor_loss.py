"""The actor's loss per response token: the policy loss, rollout correction, entropy bonus and KL-as-loss.

One function, used by the actor's update and by a replay's probe of an update (``trainer.replay``), so both
compute the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow_lab.algorithms.kl import kl_estimate
from hybridflow_lab.algorithms.registry import POLICY_LOSS_KEYWORDS, PolicyLoss
from hybridflow_lab.algorithms.rollout_correction import is_level, rollout_correction
from hybridflow_lab.config import LabConfig
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.batching import TokenLoss


def actor_token_loss(config: LabConfig, policy_loss: PolicyLoss, kl_coef: float
                     ) -> Callable[[torch.nn.Module, DataBatch], TokenLoss]:
    """The loss of a micro-batch under ``config``'s algorithm settings (see ``ActorWorker.update_actor``)."""
    algorithm, temperature, remove_padding = config.algorithm, config.rollout.temperature, \
        config.actor.engine.remove_padding
    tis = is_level(algorithm.rollout_is, config.rollout.max_staleness > 0, algorithm.rollout_mask)
    options = {key: getattr(algorithm, key) for key in POLICY_LOSS_KEYWORDS}
    options["dual_clip"] = options["dual_clip"] or None

    def loss(module: torch.nn.Module, micro: DataBatch) -> TokenLoss:
        mask = micro["response_mask"]
        log_probs, entropy = response_log_probs(module, micro, temperature, True, remove_padding,
                                                 entropy_grad=bool(algorithm.entropy_coef))
        old_log_probs = micro["old_log_probs"] if "old_log_probs" in micro else log_probs.detach()
        token_loss, diagnostics = policy_loss(log_probs, old_log_probs, micro["advantages"], mask, **options)
        out = TokenLoss(token_loss, means={"entropy": entropy.detach(), **diagnostics})
        if "rollout_log_probs" in micro:
            weights, correction = rollout_correction(
                old_log_probs, micro["rollout_log_probs"], mask, tis, algorithm.rollout_is_cap,
                algorithm.rollout_mask, algorithm.rollout_mask_low, algorithm.rollout_mask_high)
            out.loss = out.loss * weights
            out.means.update({f"rollout_{k}": v for k, v in correction.items()})
            out.peaks["rollout_mismatch_max"] = correction["mismatch"]
        out.terms["pg_loss"] = out.loss
        if algorithm.entropy_coef:
            out.loss = out.loss - algorithm.entropy_coef * entropy
        if "ref_log_probs" in micro:
            out.means["kl"] = old_log_probs - micro["ref_log_probs"]
        if kl_coef:
            kl = kl_estimate(log_probs, micro["ref_log_probs"], algorithm.kl_loss_kind)
            out.loss = out.loss + kl_coef * kl
            out.terms["kl_loss"] = kl
        return out

    return loss
