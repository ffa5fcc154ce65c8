"""Pipeline parallelism: the decoder split into stages by layers, run by torch.distributed.pipelining's schedules on
gloo ranks, gives the single-process model's losses and gradients, alone and with tensor and data parallelism."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.controller import Mesh, ResourcePool, Role, WorkerGroup
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.pipeline import DecoderStage, stage_layers
from hybridflow_lab.models.tensor_parallel import TensorParallel, shard
from tests.hybrid_workers import PipelineProbe

MICRO_BATCHES = 4


def test_stages_take_contiguous_layers_the_earlier_ones_one_more_where_they_do_not_divide():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    with pytest.raises(ValueError, match="5 pipeline stages for 4 layers: each stage needs a layer; use 1 to 4"):
        stage_layers(4, 5)


def test_the_stages_state_dicts_together_are_the_models(model_dir):
    full = load_causal_lm(model_dir)
    names = [set(DecoderStage(full, index, 3).state_dict()) for index in range(3)]
    assert set.union(*names) == set(full.state_dict()) and sum(map(len, names)) == len(full.state_dict())
    assert "model.embed_tokens.weight" in names[0] and {"model.norm.weight", "lm_head.weight"} <= names[2]


@pytest.mark.ray
def test_pipelined_losses_and_gradients_equal_the_single_process_model(ray_cluster, model_dir):
    full = load_causal_lm(model_dir)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (8, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left-padded rows
    mask[6, :2] = 0
    per_token = full(ids, mask).log_softmax(-1)[..., 3] * mask
    per_token.sum().backward()
    layouts = {"p2 t2": Mesh.of(pp=2, tp=2), "p2 d2": Mesh.of(pp=2, dp=2), "p4": Mesh.of(pp=4)}
    group = WorkerGroup(Role(PipelineProbe, model_dir), ResourcePool(4), meshes=layouts, name="pp-probe")
    try:
        for (layout, mesh), schedule in zip(layouts.items(), ("1f1b", "gpipe", "1f1b"), strict=True):
            replicas = mesh.axis_size("dp")
            rows = len(ids) // replicas // MICRO_BATCHES
            expected = [float(per_token[start : start + rows].sum().detach()) for start in range(0, len(ids), rows)]
            outs = group.loss_and_grads(layout, ids, mask, schedule, MICRO_BATCHES)
            last = [out["losses"] for out in outs if out["stage"] == mesh.axis_size("pp") - 1]
            # each last stage's replica holds its rows' micro-batches, in order (its TP peers the same)
            assert [loss for replica in last[:: mesh.axis_size("tp")] for loss in replica] == \
                pytest.approx(expected, rel=1e-5), layout
            for out in outs:
                for name, grad in out["grads"].items():
                    torch.testing.assert_close(grad, shard(dict(full.named_parameters())[name].grad, name,
                                                                     TensorParallel(*out["tp"])),
                                               rtol=1e-4, atol=2e-5, msg=f"{layout}: {name}")
    finally:
        group.shutdown()


def test_micro_batches_padded_to_one_shape_keep_their_losses(model_dir):
    from hybridflow_lab.engines.forward import count_response_tokens, response_nll
    from hybridflow_lab.engines.pipeline_engine import padded_alike
    from hybridflow_lab.smoke.checks import sequences

    model = load_causal_lm(model_dir)
    short, long = sequences(rows=8, response=6, seed=1), sequences(rows=6, response=10, seed=2)
    padded = padded_alike([short, long])
    assert [tuple(micro["input_ids"].shape) for micro in padded] == [(8, 16), (8, 16)]
    assert [tuple(micro["responses"].shape) for micro in padded] == [(8, 10), (8, 10)]
    for micro, padded_micro in zip((short, long), padded, strict=True):
        assert count_response_tokens(padded_micro) == count_response_tokens(micro)
        torch.testing.assert_close(response_nll(model, padded_micro)[0], response_nll(model, micro)[0])


def test_a_schedule_that_cannot_run_the_batch_is_refused_before_any_stage_starts(model_dir):
    from hybridflow_lab.models.pipeline import Pipeline

    pipeline = Pipeline(DecoderStage(load_causal_lm(model_dir), 0, 2), None, "1f1b")
    ids = torch.ones(6, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"1F1B schedule needs at least as many micro-batches as stages \(2\); got 1"):
        pipeline.run(ids, torch.ones_like(ids), 1, lambda logits, rows: logits.sum(), train=True)
    with pytest.raises(ValueError, match="6 rows do not split into 4 equal micro-batches"):
        pipeline.run(ids, torch.ones_like(ids), 4, lambda logits, rows: logits.sum(), train=True)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; schedules: 1f1b, gpipe"):
        Pipeline(pipeline.stage, None, "zb")
