"""The critic role: a value per response token, trained with PPO's clipped value loss."""

from __future__ import annotations

import torch

from hybridflow_lab.algorithms.losses import clipped_value_loss
from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_values
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.batching import average, micro_batches, minibatches, per_rank_minibatch


class CriticWorker(Worker):
    """Value model on one rank; starts from ``critic.model_path`` (default: the actor's backbone)."""

    def __init__(self, config: LabConfig) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        role, batch = config.critic, config.batch
        micro = batch.micro_batch_sequences_per_rank
        model = load_scalar_model(role.model_path or config.actor.model_path, seed=config.seed)
        self.engine = build_train_engine(
            role.engine.backend, model, role.optim, zero_stage=role.engine.zero_stage, micro_batch_size=micro,
            micro_batches_per_step=per_rank_minibatch(batch, self.world_size) // micro, offload=role.engine.offload,
            bf16=role.engine.bf16,
        )
        self.updates = 0

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: DataBatch) -> DataBatch:
        """``values`` ``[rows, response length]``: the value of the state before each response token."""
        parts = self.engine.infer(micro_batches(batch, self.config.batch.micro_batch_sequences_per_rank),
                                  response_values)
        return DataBatch({"values": torch.cat(parts) * batch["response_mask"]})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: DataBatch, clip: float = 0.2) -> DataBatch:
        """Regress values on ``returns`` (needs ``values`` from before the update); metrics in meta."""
        def loss(module: torch.nn.Module, micro: DataBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            values = response_values(module, micro)
            return clipped_value_loss(values, micro["values"], micro["returns"], micro["response_mask"], clip)

        steps = []
        self.updates += 1
        size = per_rank_minibatch(self.config.batch, self.world_size)
        for mini in minibatches(batch, size, self.config.batch.update_epochs, self.config.seed + self.updates):
            micros = micro_batches(mini, self.config.batch.micro_batch_sequences_per_rank)
            steps.append(self.engine.train_step(micros, loss, count_response_tokens))
        return DataBatch(meta={"metrics": {f"critic/{'vf_loss' if k == 'loss' else k}": v
                                           for k, v in average(steps).items()}})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)
