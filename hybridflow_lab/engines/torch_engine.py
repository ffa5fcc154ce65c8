"""The plain-torch engine: one process, or DistributedDataParallel over a process group.

It is the reference the sharded engines are tested against, and the engine of the local backend.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridflow_lab.engines.train_base import OptimConfig, TorchOptimizerEngine
from hybridflow_lab.models.factory import load_weights, save_model_dir


class TorchEngine(TorchOptimizerEngine):
    """Full weights on every rank; gradients averaged by DDP when the group has several ranks."""

    name = "torch"

    def __init__(self, model: nn.Module, optim: OptimConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model.parameters(), optim, group)
        self._model = model
        self.module = DistributedDataParallel(model, process_group=group) if self.dp_size > 1 else model

    @property
    def model(self) -> nn.Module:
        return self._model

    def _accumulating(self, last: bool) -> AbstractContextManager[Any]:
        if isinstance(self.module, DistributedDataParallel) and not last:
            return self.module.no_sync()
        return nullcontext()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._model.state_dict().items()}

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """An HF model directory plus ``optimizer.pt`` (loadable with ``weights_only=True``)."""
        path = Path(path)
        if not dist.is_initialized() or dist.get_rank(self.group) == 0:
            save_model_dir(self._model, path)
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "global_step": self.global_step}, path / "optimizer.pt")
        if self.dp_size > 1:
            dist.barrier(group=self.group)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        load_weights(self._model, path)
        state = torch.load(path / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = state["global_step"]
