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
from torch.distributed.tensor import DTensor

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.engines.train_base import TorchOptimizerEngine
from hybridflow_lab.engines.training_state import Moments
from hybridflow_lab.models.causal_lm import decoder_layers
from hybridflow_lab.models.lora import has_adapters, trainable_names, trainable_parameters


def shard_decoder(model: nn.Module, mesh: DeviceMesh, bf16: bool = False, offload: bool = False) -> None:
    """FSDP2 over ``mesh``: every decoder layer, then the root; each moves to the mesh's device as it is sharded,
    so the whole model never sits there at once. ``bf16`` computes in bfloat16 (float32 gradient reduction),
    ``offload`` keeps the shards in host memory."""
    options: dict[str, Any] = {"mesh": mesh}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)


FULL = StateDictOptions(full_state_dict=True)  # unsharded tensors on every rank
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0's CPU only


class FSDPEngine(TorchOptimizerEngine):
    """Parameters, gradients and optimizer state sharded over ``mesh`` (default: every rank)."""

    name = "fsdp"

    def __init__(self, model: nn.Module, optim: OptimConfig, mesh: DeviceMesh | None = None,
                 offload: bool = False, bf16: bool = False, device: str = "cpu") -> None:
        if mesh is None:
            mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        shard_decoder(model, mesh, bf16, offload)
        super().__init__(trainable_parameters(model), optim, mesh.get_group(), device=device)  # after sharding
        self.module = model
        self.state_on_host = offload

    @property
    def model(self) -> nn.Module:
        return self.module

    def accumulating(self, last: bool) -> AbstractContextManager[Any]:
        return self._gradient_sync(last)

    @contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            tensor = param.detach()
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # one all-gather each

    def _full_moments(self) -> Moments:
        return get_optimizer_state_dict(self.module, self.optimizer, options=FULL_ON_RANK0).get("state", {})

    def _load_moments(self, moments: Moments) -> None:
        groups = get_optimizer_state_dict(self.module, self.optimizer, options=FULL)["param_groups"]
        set_optimizer_state_dict(self.module, self.optimizer, {"state": moments, "param_groups": groups},
                                 options=FULL)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Sharded weights (under LoRA the adapters only) and optimizer state (torch.distributed.checkpoint) plus the
        schedule."""
        state = {"model": self._checkpointed_weights(),
                 "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))
        if dist.get_rank() == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "global_step": self.global_step},
                       Path(path) / "schedule.pt")
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        state = {"model": self._checkpointed_weights(),
                 "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        partial = StateDictOptions(strict=not has_adapters(self.module))  # LoRA: the frozen base stays as built
        set_model_state_dict(self.module, state["model"], options=partial)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        schedule = torch.load(Path(path) / "schedule.pt", weights_only=True)
        self.scheduler.load_state_dict(schedule["scheduler"])
        self.global_step = schedule["global_step"]

    def _checkpointed_weights(self) -> dict[str, Any]:
        state = get_model_state_dict(self.module)
        if not has_adapters(self.module):
            return state
        trained = trainable_names(self.module)
        return {name: tensor for name, tensor in state.items() if name in trained}
