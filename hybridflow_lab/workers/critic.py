"""The critic role: a value per response token, trained with PPO's clipped value loss."""

from __future__ import annotations

import torch

from hybridflow_lab.algorithms.losses import clipped_value_loss
from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import Dispatch, register
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.engines.forward import response_values
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.batching import TokenLoss, micro_batches, train_minibatches
from hybridflow_lab.workers.trained_role import TrainedRole


class CriticWorker(TrainedRole):
    """Value model on one rank; starts from ``critic.model_path`` (default: the actor's backbone)."""

    trained_heads = ("score",)  # under LoRA the value head is trained in full

    def __init__(self, config: LabConfig, state: TrainingState | None = None) -> None:
        """``state``: the critic's training state to continue from (another layout's, ``Lab.reconfigure``)."""
        torch.manual_seed(config.seed)
        self.config = config
        model = load_scalar_model(config.critic.model_path or config.actor.model_path, seed=config.seed)
        self.engine = self.build_engine(config.critic, model, state=state)

    def _values(self, module: torch.nn.Module, batch: DataBatch) -> torch.Tensor:
        return response_values(module, batch, self.config.critic.engine.remove_padding)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: DataBatch) -> DataBatch:
        """``values`` ``[rows, response length]``: the value of the state before each response token."""
        micros = micro_batches(batch, self.config.batch)
        values = micros.in_row_order(self.engine.infer(micros.parts, self._values))
        return DataBatch({"values": values * batch["response_mask"]})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: DataBatch, seed: int = 0) -> DataBatch:
        """Regress values on ``returns`` (needs ``values`` from before the update); metrics in meta."""
        clip = self.config.algorithm.value_clip

        def loss(module: torch.nn.Module, micro: DataBatch) -> TokenLoss:
            value_loss, diagnostics = clipped_value_loss(self._values(module, micro), micro["values"],
                                                         micro["returns"], micro["response_mask"], clip)
            return TokenLoss(value_loss, means=diagnostics)

        steps = train_minibatches(self.engine, batch, self.config, self.data_parallel_size, seed, loss)
        return DataBatch(meta={"metrics": {f"critic/{'vf_loss' if k == 'loss' else k}": v for k, v in steps.items()}})
