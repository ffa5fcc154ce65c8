"""The critic role: a value per response token, trained with PPO's clipped value loss."""

from __future__ import annotations

import torch

from hybridflow_lab.algorithms.losses import aggregate, clipped_value_loss, loss_units
from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import Dispatch, register
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.engines.forward import response_values
from hybridflow_lab.engines.train_base import StepMetrics
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.batching import mean_over_steps, micro_batches, optimizer_steps
from hybridflow_lab.workers.trained_role import TrainedRole


class CriticWorker(TrainedRole):
    """Value model on one rank; starts from ``critic.model_path`` (default: the actor's backbone)."""

    trained_heads = ("score",)  # under LoRA the value head is trained in full

    def __init__(self, config: LabConfig, state: TrainingState | None = None) -> None:
        """``state``: the critic's training state to continue from (another layout's, ``Lab.reconfigure``)."""
        torch.manual_seed(config.seed)
        self.config = config
        path, impl = config.model_source("critic")
        model = load_scalar_model(path, seed=config.seed, impl=impl)
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
        """Regress values on ``returns`` (needs ``values`` from before the update); metrics in meta. Optimizer steps
        as the actor's (``ActorWorker.update_actor``)."""
        algorithm, engine = self.config.algorithm, self.engine
        mode, norm = algorithm.aggregation, self.config.rollout.max_new_tokens
        steps = []
        for micros in optimizer_steps(batch, self.config.batch, self.data_parallel_size, seed, engine):
            metrics = engine.start_step(sum(loss_units(micro["response_mask"], mode, norm) for micro in micros))

            def micro_loss(module: torch.nn.Module, micro: DataBatch, metrics: StepMetrics = metrics) -> torch.Tensor:
                mask = micro["response_mask"]
                value_loss, diagnostics = clipped_value_loss(self._values(module, micro), micro["values"],
                                                             micro["returns"], mask, algorithm.value_clip)
                loss_sum = aggregate(value_loss, mask, mode, norm)[0]
                metrics.add("loss", loss_sum)
                metrics.add_token_means(diagnostics, mask)
                return loss_sum

            engine.backward_passes(micros, micro_loss, metrics)
            steps.append(engine.step(metrics, self.config.trainer.on_nonfinite == "skip"))
        return DataBatch(meta={"metrics": {f"critic/{'vf_loss' if k == 'loss' else k}": v
                                           for k, v in mean_over_steps(steps).items()}})
