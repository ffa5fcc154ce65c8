"""Models that only run forward passes (the reference policy), sharded the way their role trains."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def build_frozen_model(backend: str, model: nn.Module, *, zero_stage: int = 2, bf16: bool = False,
                       device: str = "cpu") -> nn.Module:
    """``model`` (on the CPU) made ready for gradient-free forward passes on ``device``, sharded like the engine
    ``backend`` trains: FSDP2 over every rank, ZeRO-3 partitions (DeepSpeed-Chat's reference), otherwise a
    whole replica. Collective when sharded; what to call for a forward pass is returned."""
    model.eval().requires_grad_(False)
    if backend == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        from hybridflow_lab.engines.fsdp_engine import shard_decoder

        shard_decoder(model, init_device_mesh(torch.device(device).type, (dist.get_world_size(),)), bf16)
        return model
    if backend == "deepspeed" and zero_stage == 3:
        from hybridflow_lab.engines.deepspeed_engine import import_deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": bf16}, "steps_per_print": 2**31}
        engine, *_ = import_deepspeed(device).initialize(model=model, config=config, dist_init_required=False)
        return engine
    model.to(device)
    return model.to(torch.bfloat16) if bf16 and backend == "deepspeed" else model  # as DeepSpeed casts the actor
