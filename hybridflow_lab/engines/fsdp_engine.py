"""torch FSDP2 (``fully_shard`` per decoder layer and at the root) over a data-parallel mesh."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from hybridflow_lab.engines.train_base import OptimConfig, TrainEngine, build_optimizer, build_scheduler
from hybridflow_lab.models.decoder import DecoderLayer


class FSDPEngine(TrainEngine):
    """Parameters, gradients and optimizer state sharded over ``mesh`` (default: every rank)."""

    name = "fsdp"

    def __init__(self, model: nn.Module, optim: OptimConfig, mesh: DeviceMesh | None = None,
                 offload: bool = False, bf16: bool = False) -> None:
        if mesh is None:
            kind = "cuda" if next(model.parameters()).is_cuda else "cpu"
            mesh = init_device_mesh(kind, (dist.get_world_size(),))
        super().__init__(mesh.get_group())
        options: dict[str, Any] = {"mesh": mesh}
        if bf16:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for layer in [m for m in model.modules() if isinstance(m, DecoderLayer)]:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        self.module = model
        self.optim_config = optim
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim)

    @property
    def model(self) -> nn.Module:
        return self.module

    def _accumulating(self, last: bool) -> AbstractContextManager[Any]:
        return self._gradient_sync(last)

    @contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.optim_config.grad_clip or float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Sharded weights and optimizer state (torch.distributed.checkpoint) plus the schedule."""
        state = {"model": get_model_state_dict(self.module),
                 "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))
        if dist.get_rank() == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "global_step": self.global_step},
                       Path(path) / "schedule.pt")
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        state = {"model": get_model_state_dict(self.module),
                 "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        schedule = torch.load(Path(path) / "schedule.pt", weights_only=True)
        self.scheduler.load_state_dict(schedule["scheduler"])
        self.global_step = schedule["global_step"]
