"""The plain-torch engine: one process, or DistributedDataParallel over a process group.

It is the reference the sharded engines are tested against, and the engine of the local backend.
Under tensor parallelism the model is this rank's TP shard and DDP runs over the data-parallel
group of ranks holding the same shard (Megatron's TP x DP).
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

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.engines.train_base import TorchOptimizerEngine
from hybridflow_lab.engines.training_state import Moments
from hybridflow_lab.models.factory import load_weights, save_model_dir
from hybridflow_lab.models.lora import has_adapters, load_adapters, save_adapters, trainable_parameters
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, gather, gather_state_dict, shard


class TorchEngine(TorchOptimizerEngine):
    """Full weights on every rank; gradients averaged by DDP when the group has several ranks. With ``bf16`` the
    forward passes run under bfloat16 autocast over float32 weights, gradients and optimizer state."""

    name = "torch"

    def __init__(self, model: nn.Module, optim: OptimConfig, group: dist.ProcessGroup | None = None,
                 tp: TensorParallel = SINGLE, device: str = "cpu", bf16: bool = False) -> None:
        model.to(device)
        super().__init__(trainable_parameters(model), optim, group, tp, device)
        self._model = model
        self.bf16 = bf16
        self.module = DistributedDataParallel(model, process_group=group) if self.dp_size > 1 else model

    def _offload(self) -> None:
        # DDP's reducer holds gradient buckets the size of the model, and its hooks sit on the parameters' gradient
        # accumulators, which a move to another device replaces: its gradients would silently stop being averaged
        self.module = self._model
        super()._offload()

    def _reload(self) -> None:
        super()._reload()
        if self.dp_size > 1:  # a new reducer on the moved parameters; every rank's weights are still the same
            self.module = DistributedDataParallel(self._model, process_group=self.group, init_sync=False)

    def precision(self) -> AbstractContextManager[Any]:
        if not self.bf16:
            return nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)

    @property
    def model(self) -> nn.Module:
        return self._model

    def accumulating(self, last: bool) -> AbstractContextManager[Any]:
        if isinstance(self.module, DistributedDataParallel) and not last:
            return self.module.no_sync()
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_state_dict(self._model, self.tp)

    def _full_moments(self) -> Moments:
        return {name: {key: gather(value, name, self.tp).cpu() for key, value in self.optimizer.state[p].items()}
                for name, p in self._model.named_parameters() if p in self.optimizer.state}

    def _load_moments(self, moments: Moments) -> None:
        for name, p in self._model.named_parameters():
            if name in moments:  # AdamW's step counts stay on the CPU
                self.optimizer.state[p] = {key: shard(value, name, self.tp).to(p.device if value.dim() else "cpu",
                                                                                copy=True)
                                           for key, value in moments[name].items()}

    def _writes_model_dir(self) -> bool:
        """Whether this rank writes the checkpoint's model directory (one rank of the data-parallel replicas that do
        write: the first TP shard's)."""
        return self.tp.rank == 0

    def _optimizer_file(self, path: Path) -> Path:
        return path / (f"optimizer-tp{self.tp.rank}.pt" if self.tp.enabled else "optimizer.pt")

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """An HF model directory (full weights; under LoRA the adapters only) and each TP shard's optimizer state
        (``weights_only`` loadable)."""
        path = Path(path)
        state = self.full_state_dict()  # collective under TP
        if not dist.is_initialized() or dist.get_rank(self.group) == 0:
            if self._writes_model_dir() and has_adapters(self._model):
                save_adapters(self._model, path, state)
            elif self._writes_model_dir():
                save_model_dir(self._model, path, state=state)
            if self.tp.enabled:
                dist.barrier(group=self.tp.group)  # the directory exists before the other shards write into it
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "global_step": self.global_step}, self._optimizer_file(path))
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        self._load_weights(path)
        state = torch.load(self._optimizer_file(path), weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = state["global_step"]

    def _load_weights(self, path: Path) -> None:
        """The checkpoint's weights (or LoRA adapters) into this rank's model."""
        if has_adapters(self._model):
            load_adapters(self._model, path)
        else:
            load_weights(self._model, path, self.tp)
