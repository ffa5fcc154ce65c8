"""The actor role: trains the policy, generates with it and keeps the frozen reference, in one process per rank.

This is the paper's colocated actor: generation runs on the training weights in place
when they are whole on every rank (torch, ZeRO-1/2); with ZeRO-3 or FSDP the rollout gets a
gathered copy before each generation (the hybrid-engine milestone removes that copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoTokenizer

from hybridflow_lab.algorithms.kl import kl_estimate
from hybridflow_lab.algorithms.losses import ppo_policy_loss
from hybridflow_lab.algorithms.registry import PolicyLoss
from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import Dispatch, register
from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.torch_rollout import TorchRollout
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.batching import micro_batches, train_minibatches
from hybridflow_lab.workers.trained_role import TrainedRole

if TYPE_CHECKING:
    from hybridflow_lab.engines.vllm_rollout import VllmRollout


def sampling_params(config: LabConfig, **overrides: object) -> SamplingParams:
    rollout = config.rollout
    values = {"max_new_tokens": rollout.max_new_tokens, "temperature": rollout.temperature, "top_p": rollout.top_p,
              "top_k": rollout.top_k, "n": config.batch.samples_per_prompt, "ignore_eos": rollout.ignore_eos}
    return SamplingParams(**{**values, **overrides})


class ActorWorker(TrainedRole):
    """Policy training, generation and the reference policy on one rank."""

    def __init__(self, config: LabConfig) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        path = config.actor.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        role = config.actor
        self.engine = self.build_engine(role, load_causal_lm(path))
        self.reference = load_causal_lm(path).eval().requires_grad_(False)
        self.shares_weights = config.rollout.engine == "torch" and (role.engine.backend == "torch" or (
            role.engine.backend == "deepspeed" and role.engine.zero_stage < 3))
        self.rollout = self._build_rollout(path)
        self.updates = 0
        self.synced_updates = 0

    def _build_rollout(self, path: str) -> TorchRollout | VllmRollout:
        params, eos, pad = sampling_params(self.config), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if self.config.rollout.engine == "vllm":
            from hybridflow_lab.engines.vllm_rollout import VllmRollout

            rollout = self.config.rollout
            return VllmRollout(path, params, eos, pad, rollout.tensor_parallel, rollout.gpu_memory_utilization,
                               self.config.seed + self.rank)
        return TorchRollout(self.engine.model if self.shares_weights else load_causal_lm(path), params, eos, pad)

    def _sync_generation_weights(self) -> None:
        """Give the rollout the weights of the latest update when it does not share them (collective)."""
        if self.shares_weights or self.synced_updates == self.updates:
            return
        with self.span("weight_sync") as attrs:
            state = self.engine.full_state_dict()
            if isinstance(self.rollout, TorchRollout):
                self.rollout.model.load_state_dict(state)
            else:
                self.rollout.update_weights(state)
            attrs["bytes_moved"] = sum(t.numel() * t.element_size() for t in state.values())
        self.synced_updates = self.updates

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: DataBatch, greedy: bool = False, n: int | None = None,
                           seed: int | None = None) -> DataBatch:
        """``samples_per_prompt`` responses per left-padded prompt (``input_ids``, ``attention_mask``).

        Returns the sequence layout for training, ``rollout_log_probs``, the decoded
        ``response_text``, and every non-tensor column of the prompts repeated per sample.
        """
        self._sync_generation_weights()
        params = sampling_params(self.config, greedy=greedy, n=n or self.config.batch.samples_per_prompt,
                                 seed=None if seed is None else seed * 1009 + self.rank)
        with self.span("generate", prompts=len(prompts)) as attrs:
            out = self.rollout.generate(prompts["input_ids"], prompts["attention_mask"], params)
            attrs["tokens"] = int(out["response_mask"].sum())
        texts = self.tokenizer.batch_decode(out["responses"] * out["response_mask"], skip_special_tokens=True)
        repeated = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensors.items()}
        return DataBatch(out, {**repeated, "response_text": texts}, prompts.meta)

    def _log_probs(self, model: torch.nn.Module, batch: DataBatch, with_entropy: bool) -> DataBatch:
        size = self.config.batch.micro_batch_sequences_per_rank
        temperature = self.config.rollout.temperature

        def forward(module: torch.nn.Module, micro: DataBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return response_log_probs(module, micro, temperature, with_entropy)

        micros = micro_batches(batch, size)
        if model is self.engine.module:
            parts = self.engine.infer(micros, forward)
        else:
            with torch.no_grad():
                parts = [forward(model, micro) for micro in micros]
        columns = {"log_probs": torch.cat([p[0] for p in parts])}
        if with_entropy:
            columns["entropy"] = torch.cat([p[1] for p in parts])
        return DataBatch(columns)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: DataBatch) -> DataBatch:
        """Log-probs (``old_log_probs``) and entropies of the responses under the current policy."""
        out = self._log_probs(self.engine.module, batch, with_entropy=True)
        return DataBatch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: DataBatch) -> DataBatch:
        """Log-probs of the responses under the frozen reference policy (``ref_log_probs``)."""
        return DataBatch({"ref_log_probs": self._log_probs(self.reference, batch, with_entropy=False)["log_probs"]})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: DataBatch, policy_loss: PolicyLoss = ppo_policy_loss, kl_coef: float = 0.0,
                     seed: int = 0) -> DataBatch:
        """Policy updates over this rank's share; needs ``advantages``.

        Without ``old_log_probs`` the update's own forward pass stands in for them (the PPO ratio
        is 1), which is exact when the batch gets one optimizer step: the weights that generated
        the batch are the ones being updated. ``policy_loss`` is any registered loss (a function,
        so one defined in a notebook works in the workers); ``kl_coef`` > 0 adds the KL to the
        reference as a loss term (needs ``ref_log_probs``). One optimizer step per
        ``update_minibatch_sequences`` (over all ranks), ``update_epochs`` passes, rows shuffled
        with ``seed``. Returns no rows and the mean metrics in ``meta["metrics"]``.
        """
        needed = ["responses", "response_mask", "advantages", *(["ref_log_probs"] if kl_coef else [])]
        missing = [k for k in needed if k not in batch]
        if missing:
            raise KeyError(f"update_actor needs columns {missing}; compute them first (compute_log_prob, "
                           "compute_ref_log_prob, advantages)")
        algorithm, temperature = self.config.algorithm, self.config.rollout.temperature

        def loss(module: torch.nn.Module, micro: DataBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mask = micro["response_mask"]
            log_probs, entropy = response_log_probs(module, micro, temperature, with_entropy=True)
            old_log_probs = micro["old_log_probs"] if "old_log_probs" in micro else log_probs.detach()
            token_loss, metrics = policy_loss(log_probs, old_log_probs, micro["advantages"], mask,
                                              clip_low=algorithm.clip_low, clip_high=algorithm.clip_high,
                                              dual_clip=algorithm.dual_clip or None)
            metrics = {"pg_loss": token_loss, "entropy": entropy.detach(), **metrics}
            if algorithm.entropy_coef:
                token_loss = token_loss - algorithm.entropy_coef * entropy
            if "ref_log_probs" in micro:
                metrics["kl"] = old_log_probs - micro["ref_log_probs"]
            if kl_coef:
                kl = kl_estimate(log_probs, micro["ref_log_probs"], algorithm.kl_kind)
                token_loss = token_loss + kl_coef * kl
                metrics["kl_loss"] = kl
            return token_loss, metrics

        steps = train_minibatches(self.engine, batch, self.config, self.world_size, seed, loss)
        self.updates += 1
        return DataBatch(meta={"metrics": {f"actor/{k}": v for k, v in steps.items() if k != "loss"}})

    def weights_loaded(self) -> None:
        self.updates += 1  # the rollout must pick up the loaded weights
