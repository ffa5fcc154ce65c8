"""Megatron-style tensor parallelism: sharded forward and backward equal the single-process model."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.controller import Mesh, ResourcePool, Role, WorkerGroup
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.tensor_parallel import TensorParallel, check_shardable, shard, split_dim
from tests.hybrid_workers import TensorParallelProbe

# conftest's model_dir builds this module's model: Qwen3's, whose query and key norms each rank applies to its own
# heads only (their weights' gradients are summed over the group)
MODEL_SIZE, MODEL_SEED, MODEL_ARCH = "small", 5, "qwen3"


def test_which_weights_split_along_which_dimension():
    assert split_dim("model.layers.3.self_attn.q_proj.weight") == 0
    assert split_dim("model.layers.3.self_attn.k_proj.bias") == 0
    assert split_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert split_dim("model.embed_tokens.weight") == 0 and split_dim("lm_head.weight") == 0
    assert split_dim("model.layers.0.input_layernorm.weight") is None and split_dim("model.norm.weight") is None
    weight = torch.arange(24.0).view(4, 6)
    assert shard(weight, "mlp.down_proj.weight", TensorParallel(3, 1)).tolist() == weight[:, 2:4].tolist()
    assert shard(weight, "mlp.up_proj.weight", TensorParallel(2, 1)).tolist() == weight[2:].tolist()


def test_a_size_that_does_not_split_the_model_names_the_dimension(model_dir):
    config = load_causal_lm(model_dir).config
    message = r"does not divide the model's num_attention_heads \(8\); use one of \[1, 2, 4\]"
    with pytest.raises(ValueError, match=message):
        check_shardable(config, 3)


@pytest.mark.ray
def test_sharded_forward_and_backward_equal_the_full_model(ray_cluster, model_dir):
    full = load_causal_lm(model_dir)
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    logits = full(ids, mask)
    (logits.log_softmax(-1)[..., 3] * mask).sum().backward()
    meshes = {"tp4": Mesh.of(tp=4), "dp2tp2": Mesh.of(dp=2, tp=2)}
    group = WorkerGroup(Role(TensorParallelProbe, model_dir), ResourcePool(4), meshes=meshes, name="tp-probe")
    try:
        for mesh, size in (("tp4", 4), ("dp2tp2", 2)):
            for out in group.forward_backward(mesh, ids, mask):
                torch.testing.assert_close(out["logits"], logits.detach(), rtol=1e-5, atol=1e-5)
                tp = TensorParallel(size, out["tp_rank"])
                for name, param in full.named_parameters():
                    # atol 2e-5: each head norm's gradient is summed over the group, in another order than one process
                    torch.testing.assert_close(out["grads"][name], shard(param.grad, name, tp), rtol=1e-4, atol=2e-5)
    finally:
        group.shutdown()


def test_a_size_one_model_is_the_plain_model(model_dir):
    full = load_causal_lm(model_dir)
    single = DecoderLM(full.config)
    single.load_state_dict(full.state_dict())
    ids = torch.randint(3, 100, (2, 5))
    assert torch.equal(single(ids), full(ids))
