"""Training engines (torch, DeepSpeed ZeRO, FSDP2) and rollout engines (built-in torch, vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from hybridflow_lab.config.schema import TRAIN_BACKENDS, OptimConfig
from hybridflow_lab.engines.sampling import SamplingParams
from hybridflow_lab.engines.train_base import TrainEngine
from hybridflow_lab.engines.training_state import TrainingState
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from hybridflow_lab.engines.pipeline_engine import StagePlace


def build_train_engine(backend: str, model: nn.Module, optim: OptimConfig, *, zero_stage: int = 2,
                       micro_batch_size: int = 1, micro_batches_per_step: int = 1, offload: bool = False,
                       bf16: bool = False, dp_group: dist.ProcessGroup | None = None,
                       tp: TensorParallel = SINGLE, stage: StagePlace | None = None, device: str = "cpu",
                       state: TrainingState | None = None) -> TrainEngine:
    """The training engine named ``backend`` around ``model`` (collective when several ranks run it).

    ``model`` is this rank's ``tp`` shard, still on the CPU: the engine puts it on ``device`` (ZeRO-3 and FSDP
    shard it on the way, so the whole model never sits on the device); ``dp_group`` (default: all ranks)
    averages its gradients. Only the torch engine trains tensor-parallel shards and pipeline stages (``stage``: this
    rank's, the other stages' layers dropped): ZeRO and FSDP shard over data parallel instead. With ``state``
    (another engine's ``training_state``, any layout) it continues that run.
    """
    if (tp.enabled or stage is not None) and backend != "torch":
        raise ValueError(f"the {backend} engine shards over data parallel instead of tensor parallel and pipeline "
                         "stages; train shards and stages with the torch engine")
    if state is not None:
        state.load_weights_into(model, tp)
    engine = _engine(backend, model, optim, zero_stage, micro_batch_size, micro_batches_per_step, offload, bf16,
                     dp_group, tp, stage, device)
    if state is not None:
        engine.load_training_state(state)
    return engine


def _engine(backend: str, model: nn.Module, optim: OptimConfig, zero_stage: int, micro_batch_size: int,
            micro_batches_per_step: int, offload: bool, bf16: bool, dp_group: dist.ProcessGroup | None,
            tp: TensorParallel, stage: StagePlace | None, device: str) -> TrainEngine:
    if stage is not None:
        from hybridflow_lab.engines.pipeline_engine import PipelineEngine

        if dp_group is None:
            raise ValueError("a pipeline stage's engine needs its data-parallel group (its replicas; one rank without "
                             "data parallelism)")
        return PipelineEngine(model, optim, stage, dp_group, tp, device, bf16)
    if backend == "torch":
        from hybridflow_lab.engines.torch_engine import TorchEngine

        return TorchEngine(model, optim, dp_group, tp, device, bf16)
    if backend == "deepspeed":
        from hybridflow_lab.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, optim, zero_stage, micro_batch_size, micro_batches_per_step, offload, bf16,
                               device)
    if backend == "fsdp":
        from hybridflow_lab.engines.fsdp_engine import FSDPEngine

        return FSDPEngine(model, optim, offload=offload, bf16=bf16, device=device)
    raise ValueError(f"unknown training backend {backend!r}; backends: {', '.join(TRAIN_BACKENDS)}")


__all__ = ["SamplingParams", "TrainEngine", "TrainingState", "build_train_engine"]
