"""Workers that train a tiny model with each engine, for the engine-equivalence tests."""

from __future__ import annotations

import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.config import BatchConfig, LoraConfig, OptimConfig
from hybridflow_lab.controller import Dispatch, register
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_nll
from hybridflow_lab.engines.train_base import NonFiniteUpdate
from hybridflow_lab.engines.training_state import TrainingState
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.lora import apply_lora
from hybridflow_lab.workers.batching import micro_batches
from hybridflow_lab.workers.trained_role import TrainedRole


class EngineProbe(TrainedRole):
    """Trains with one engine on its data-parallel share and reports the global losses; checkpoints as every
    trained role does."""

    def __init__(self, model_dir: str, backend: str, zero_stage: int = 2, micro_batches: int = 2,
                 offload: bool = False, bf16: bool = False, lora_rank: int = 0,
                 state: TrainingState | None = None) -> None:
        torch.manual_seed(0)
        model = load_causal_lm(model_dir)
        if lora_rank:
            apply_lora(model, LoraConfig(rank=lora_rank))
        self.engine = build_train_engine(backend, model, OptimConfig(lr=1e-2, grad_clip=1.0),
                                         zero_stage=zero_stage, micro_batches_per_step=micro_batches,
                                         offload=offload, bf16=bf16, device=self.device, state=state)
        self.micro_batches = micro_batches

    @register(Dispatch.DP_COMPUTE)
    def train(self, batch: DataBatch, steps: int, offload_between: bool = False) -> DataBatch:
        """``steps`` steps; with ``offload_between``, the training state goes to host memory and back before each
        but the first (as around every generation of a rollout engine that holds its own weights)."""
        losses, norms = [], []
        for step in range(steps):
            if offload_between and step:
                self.engine.offload()
                self.engine.reload()
            result = self.engine.train_step(batch.chunk(self.micro_batches), response_nll,
                                            count_response_tokens)
            losses.append(result["loss"])
            norms.append(result["grad_norm"])
        return DataBatch({"row": torch.ones(len(batch))}, meta={"losses": losses, "grad_norms": norms})

    @register(Dispatch.DP_COMPUTE)
    def train_by_tokens(self, batch: DataBatch, steps: int, budget: int) -> DataBatch:
        """``train`` with micro-batches of at most ``budget`` real tokens (as many on every rank)."""
        losses, counts = [], []
        for _ in range(steps):
            micros = micro_batches(batch, BatchConfig(micro_batch_tokens_per_rank=budget), self.engine).parts
            losses.append(self.engine.train_step(micros, response_nll, count_response_tokens)["loss"])
            counts.append(len(micros))
        return DataBatch({"row": torch.ones(len(batch))}, meta={"losses": losses, "micro_batches": counts})

    @register(Dispatch.DP_COMPUTE)
    def train_with_nan_gradient(self, batch: DataBatch, rank: int) -> DataBatch:
        """One step whose loss is finite but whose gradient on ``rank`` holds a NaN (a hook on one weight);
        the error's text, or the step's metrics, in meta."""
        weight = next(self.engine.model.parameters())
        hook = weight.register_hook(lambda grad: grad * float("nan")) if self.rank == rank else None
        try:
            result = self.engine.train_step(batch.chunk(self.micro_batches), response_nll, count_response_tokens)
        except NonFiniteUpdate as error:
            result = {"error": str(error)}
        finally:
            if hook is not None:
                hook.remove()
        return DataBatch({"row": torch.ones(len(batch))}, meta=result)

    @register(Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()

    @register(Dispatch.ONE_TO_ALL)
    def gradient_bucket(self) -> dict[str, int]:
        """The elements of DeepSpeed's gradient bucket (allocated whole on every rank) and of the trained model."""
        return {"bucket": self.engine.engine.zero_reduce_bucket_size(),
                "parameters": sum(p.numel() for p in self.engine.engine.module.parameters())}

    @register(Dispatch.ONE_TO_ALL)
    def streamed_weights(self) -> dict[str, torch.Tensor]:
        """The full weights as a rollout engine's sync receives them (``full_weights``, one module at a time)."""
        return dict(self.engine.full_weights())
