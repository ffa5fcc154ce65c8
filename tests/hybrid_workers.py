"""Worker classes for the tensor-parallel and hybrid-engine tests."""

from __future__ import annotations

import torch

from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.tensor_parallel import TensorParallel, shard_state_dict


class TensorParallelProbe(Worker):
    """Builds the model sharded along a mesh's ``tp`` axis from a full checkpoint; runs forward and backward."""

    def __init__(self, model_dir: str) -> None:
        self.full = load_causal_lm(model_dir)

    def tensor_parallel(self, mesh: str) -> TensorParallel:
        device_mesh = self.device_mesh(mesh)
        return TensorParallel(device_mesh.size(device_mesh.mesh_dim_names.index("tp")),
                              device_mesh.get_local_rank("tp"), device_mesh.get_group("tp"))

    @register(Dispatch.ONE_TO_ALL)
    def forward_backward(self, mesh: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """Logits of the sharded model and the gradients of its shards for a fixed scalar loss."""
        tp = self.tensor_parallel(mesh)
        model = DecoderLM(self.full.config, tp)
        model.load_state_dict(shard_state_dict(self.full.state_dict(), tp))
        logits = model(input_ids, attention_mask)
        (logits.log_softmax(-1)[..., 3] * attention_mask).sum().backward()
        return {"tp_rank": tp.rank, "logits": logits.detach(),
                "grads": {name: p.grad for name, p in model.named_parameters()}}
