"""A trained model's state in a form no engine layout owns, so a run can move to another layout and go on.

A ``TrainingState`` holds full (unsharded) tensors under the model's own parameter names: the trained weights,
the optimizer's state of each (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``), the learning-rate schedule and
the optimizer steps taken. Every engine gathers one (``TrainEngine.training_state``, collective) and starts
from one (``build_train_engine(..., state=)``): the weights go into the model before the engine shards it, the
optimizer state into the engine's own shards after. Torch/DDP with any tensor-parallel size, ZeRO 1-3 and FSDP2
read each other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, shard_state_dict

Moments = dict[str, dict[str, torch.Tensor]]  # parameter name -> optimizer state name -> full tensor


@dataclass
class TrainingState:
    """Weights, optimizer state and schedule of a trained model, independent of its engine (module docstring)."""

    weights: dict[str, torch.Tensor]  # the trained tensors: all of them, or the adapters (and heads) under LoRA
    moments: Moments
    scheduler: dict[str, Any]
    global_step: int

    @property
    def nbytes(self) -> int:
        tensors = [*self.weights.values(), *(t for m in self.moments.values() for t in m.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load_weights_into(self, model: nn.Module, tp: TensorParallel = SINGLE) -> None:
        """Put the weights into ``model`` (this rank's ``tp`` shard, not yet wrapped by an engine); every trained
        parameter of the model must be among them."""
        trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        if missing := sorted(trained - set(self.weights)):
            raise KeyError(f"the carried state has no weights for {missing[:4]} (was it taken from another model, "
                           "or with other LoRA settings?)")
        result = model.load_state_dict(shard_state_dict(self.weights, tp), strict=False)
        if result.unexpected_keys:
            raise KeyError(f"the carried state has weights the model lacks: {result.unexpected_keys[:4]}")
