"""The base of roles that train a model with an engine: building it, and their checkpoint calls."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from hybridflow_lab.config import LabConfig, RoleConfig
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.pipeline_engine import StagePlace
from hybridflow_lab.engines.train_base import TrainEngine
from hybridflow_lab.engines.training_state import TrainingState
from hybridflow_lab.models.causal_lm import enable_gradient_checkpointing
from hybridflow_lab.models.decoder import compile_layers
from hybridflow_lab.models.lora import apply_lora, load_adapters
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel
from hybridflow_lab.workers.batching import per_rank_minibatch


class TrainedRole(Worker):
    """A role with ``self.engine``; checkpoints go through it (collective on every rank)."""

    config: LabConfig
    engine: TrainEngine
    trained_heads: tuple[str, ...] = ()  # parameters trained with the LoRA adapters (a critic's value head)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that split each batch (all of them unless the role is tensor-parallel)."""
        return self.world_size

    def build_engine(self, role: RoleConfig, model: nn.Module, dp_group: ProcessGroup | None = None,
                     tp: TensorParallel = SINGLE, state: TrainingState | None = None,
                     stage: StagePlace | None = None) -> TrainEngine:
        """``role``'s training engine around ``model`` (this rank's ``tp`` shard, on the CPU: the engine places it
        on this rank's device; ``stage``: the pipeline stage this rank trains of it), sized by the run's batch
        config; gradients are averaged over ``dp_group`` (default: all ranks); ``role.lora`` puts adapters on it
        first; ``state`` (a run's ``training_state``, from any layout) is where it continues from. Collective."""
        batch, engine = self.config.batch, role.engine
        if role.lora.enabled:
            apply_lora(model, role.lora, self.trained_heads)
        if role.lora.adapter_path and state is None:
            load_adapters(model, role.lora.adapter_path)
        if engine.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if engine.torch_compile:
            compile_layers(model)
        micro = batch.micro_batch_sequences_per_rank
        return build_train_engine(
            engine.backend, model, role.optim, zero_stage=engine.zero_stage, micro_batch_size=micro,
            micro_batches_per_step=per_rank_minibatch(batch, self.data_parallel_size) // micro,
            offload=engine.offload, bf16=engine.bf16, dp_group=dp_group, tp=tp, stage=stage, device=self.device,
            state=state,
        )

    @register(Dispatch.ONE_TO_ALL)
    def training_state(self) -> TrainingState | None:
        """The weights, optimizer state and schedule as full tensors any layout continues from (``None`` from all
        ranks but rank 0); collective."""
        state = self.engine.training_state()
        return state if self.rank == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """Called after a checkpoint replaced the weights."""
