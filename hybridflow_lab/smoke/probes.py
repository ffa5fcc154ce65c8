"""Worker roles the smoke checks drive: where ranks landed, an engine's training state, the actor's phases."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_nll
from hybridflow_lab.engines.train_base import TrainEngine
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.actor import ActorWorker
from hybridflow_lab.workers.trained_role import TrainedRole


def device_identity(device: str) -> str:
    """The physical device behind ``device``: a GPU's UUID, or the process for the CPU."""
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    return f"cpu:{os.getpid()}"


def tensor_devices(tensors: Any) -> list[str]:
    return sorted({str(t.device) for t in tensors})


def state_devices(engine: TrainEngine) -> dict[str, list[str]]:
    """Where an engine keeps its parameters (ZeRO-3: their partitions) and its optimizer state tensors."""
    params = [getattr(p, "ds_tensor", p) for p in engine.model.parameters()]
    optimizer = engine.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO wrapper holds the torch AdamW
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    return {"parameters": tensor_devices(params), "optimizer_state": tensor_devices(states)}


class PlacementProbe(Worker):
    """Reports where its rank runs and runs all-reduces on device and CPU tensors over a mesh's axes."""

    @register(Dispatch.ONE_TO_ALL)
    def report(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "identity": device_identity(self.device),
                "local_rank_env": os.environ.get("LOCAL_RANK"),
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, mesh: str) -> dict[str, dict[str, float]]:
        """Per axis of ``mesh``: the sum of ``rank + 1`` over the axis group, on this rank's device and on the CPU
        (a ``cpu:gloo,cuda:nccl`` group routes each to its backend), and what it should be."""
        out = {}
        device_mesh = self.device_mesh(mesh)
        for axis in device_mesh.mesh_dim_names:
            group = device_mesh.get_group(axis)
            sums = {}
            for where, device, dtype in (("device", self.device, torch.float32), ("cpu", "cpu", torch.float64)):
                value = torch.full((4,), self.rank + 1.0, dtype=dtype, device=device)
                dist.all_reduce(value, group=group)
                sums[where] = float(value[0])
            sums["expected"] = float(sum(r + 1 for r in dist.get_process_group_ranks(group)))
            out[axis] = sums
        return out


class EngineCheck(TrainedRole):
    """One training engine on a tiny model: steps, where its state lives, checkpoint save and load."""

    def __init__(self, model_dir: str, backend: str, zero_stage: int, bf16: bool, micro_batches: int) -> None:
        torch.manual_seed(0)
        self.micro_batches = micro_batches
        self.engine = build_train_engine(backend, load_causal_lm(model_dir), OptimConfig(lr=1e-3, grad_clip=1.0),
                                         zero_stage=zero_stage, micro_batches_per_step=micro_batches, bf16=bf16,
                                         device=self.device)

    @register(Dispatch.DP_COMPUTE)
    def train(self, batch: DataBatch, steps: int = 1) -> DataBatch:
        """``steps`` optimizer steps on this rank's share; the global losses in ``meta["losses"]``."""
        losses = [self.engine.train_step(batch.chunk(self.micro_batches), response_nll, count_response_tokens)["loss"]
                  for _ in range(steps)]
        return DataBatch({"row": torch.ones(len(batch), device=self.device)}, meta={"losses": losses})

    @register(Dispatch.ONE_TO_ALL)
    def state_devices(self) -> dict[str, list[str]]:
        return state_devices(self.engine)

    @register(Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.float().cpu() for name, tensor in self.engine.full_weights()}


class SmokeActor(ActorWorker):
    """The actor, with what the smoke checks read from inside it: state devices and vLLM's phases."""

    @register(Dispatch.ONE_TO_ALL)
    def state_devices(self) -> dict[str, list[str]]:
        return state_devices(self.engine)

    @register(Dispatch.ONE_TO_ALL)
    def rollout_transitions(self) -> list[str]:
        return list(getattr(self.rollout, "transitions", []))

    @register(Dispatch.ONE_TO_ALL)
    def rollout_start_seconds(self) -> float:
        """How long building this rank's vLLM engine took."""
        return self.rollout.start_seconds

    @register(Dispatch.ONE_TO_ALL)
    def sleep_frees_bytes(self) -> int:
        """Device bytes vLLM's sleep hands back (wakes it fully first; 0 on the CPU, where it cannot sleep)."""
        from hybridflow_lab.engines.vllm_rollout import WAKE_TAGS

        if not self.device.startswith("cuda"):
            return 0
        self.rollout.wake_up(*WAKE_TAGS)
        free_awake = torch.cuda.mem_get_info()[0]
        self.rollout.sleep()
        return int(torch.cuda.mem_get_info()[0] - free_awake)
