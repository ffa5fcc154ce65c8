"""Training engines on 2 gloo ranks against the single-process reference: same losses, same weights."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.controller import Mesh, ResourcePool, Role, WorkerGroup
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.host_offload import HostCopies, offload_optimizer_state, reload_optimizer_state
from hybridflow_lab.engines.train_base import StepMetrics, build_optimizer, build_scheduler
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.smoke.checks import sequences
from tests.engine_workers import EngineProbe
from tests.hybrid_workers import PipelineEngineProbe

ENGINES = [("torch", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("fsdp", 0)]
WITH_OFFLOAD = [(*engine, False) for engine in ENGINES] + [("deepspeed", 2, True), ("deepspeed", 3, True)]


def test_each_offload_copies_the_optimizer_state_into_the_host_buffers_of_the_first():
    weight = torch.nn.Parameter(torch.ones(3, 2))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    host = HostCopies()
    buffers = []
    for step in range(2):
        weight.grad = torch.full((3, 2), float(step + 1))
        optimizer.step()
        state = optimizer.state[weight]
        state.update({key: state[key].clone() for key in ("exp_avg", "exp_avg_sq")})  # as a reload to a GPU makes
        values = {key: state[key].clone() for key in ("exp_avg", "exp_avg_sq")}
        moved = offload_optimizer_state(optimizer, "cpu", host)
        buffers.append({key: state[key] for key in values})
        assert all(torch.equal(state[key], value) for key, value in values.items())
        reload_optimizer_state(moved, "cpu")
    assert all(buffers[0][key] is buffers[1][key] for key in buffers[0])
    assert len(host.buffers) == 3  # exp_avg, exp_avg_sq and the step count (on the CPU here)


def test_step_metrics_report_sums_per_loss_unit_token_means_and_valid_maxima():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = StepMetrics(units=2.0, scale=0.5)  # two sequences: the loss sum is reported per sequence
    metrics.add("loss", torch.tensor(3.0))
    metrics.add_token_means({"clipfrac": torch.tensor([[1.0, 0.0, 9.0], [1.0, 9.0, 9.0]])}, mask)
    metrics.add_max("mismatch", torch.tensor([[0.25, 0.5, 8.0], [0.125, 8.0, 8.0]]), mask)
    assert metrics.result(metrics.sums, metrics.maxima) == {"clipfrac": pytest.approx(2 / 3), "loss": 1.5,
                                                             "mismatch": 0.5}


MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it


@pytest.fixture(scope="module")
def reference(model_dir):
    """One process, four micro-batches: the losses and weights of three steps, and the losses of two more on other
    rows, which every engine must reproduce."""
    group = WorkerGroup(Role(EngineProbe, model_dir, "torch", micro_batches=4), backend="local")
    losses = group.train(sequences(), steps=3).meta["losses"]
    weights = group.weights()[0]
    later = group.train(sequences(seed=1), steps=2).meta["losses"]
    group.shutdown()
    return losses, weights, later


@pytest.mark.ray
@pytest.mark.parametrize(("backend", "stage", "offload"), WITH_OFFLOAD,
                         ids=[f"{b}{s or ''}{'-offload' if o else ''}" for b, s, o in WITH_OFFLOAD])
def test_two_ranks_match_the_single_process_reference_across_a_checkpoint(ray_cluster, model_dir, reference, tmp_path,
                                                                          backend, stage, offload):
    """Three steps on 2 ranks are the single process's, the training state offloaded to host memory and reloaded
    between them (every rank holds its weights; the stream a vLLM sync reads is the gathered state), and so are the
    next two, taken again after loading the checkpoint saved before them."""
    losses, weights, later = reference
    group = WorkerGroup(Role(EngineProbe, model_dir, backend, zero_stage=stage, micro_batches=2, offload=offload),
                        ResourcePool(2))
    try:
        out = group.train(sequences(), steps=3, offload_between=True)
        assert out.meta["losses"] == pytest.approx(losses, rel=1e-5)
        assert losses[-1] < losses[0] - 0.5  # it learns
        gathered = group.weights()
        for streamed, whole in zip(group.streamed_weights(), gathered, strict=True):  # what a vLLM sync receives
            assert list(streamed) == list(whole) and all(torch.equal(streamed[k], whole[k]) for k in whole)
        for rank_weights in gathered:  # every rank gets the full weights
            assert rank_weights.keys() == weights.keys()
            for name, value in weights.items():
                diff = (rank_weights[name] - value).abs()
                # Adam turns rounding noise in near-zero gradients (k_proj.bias's are zero in exact
                # arithmetic) into visible steps on a few elements
                assert diff.max() < 1e-3 and diff.mean() < 1e-5, name
        group.save_checkpoint(str(tmp_path / "ckpt"))
        assert group.train(sequences(seed=1), steps=2).meta["losses"] == pytest.approx(later, rel=1e-5)
        group.load_checkpoint(str(tmp_path / "ckpt"))  # back to the weights, moments and step count of step 3
        assert group.train(sequences(seed=1), steps=2).meta["losses"] == pytest.approx(later, rel=1e-5)
    finally:
        group.shutdown()


PIPELINE_LAYOUTS = {"p2 t2": (Mesh.of(pp=2, dp=1, tp=2), "1f1b", 4), "p2 d2": (Mesh.of(pp=2, dp=2), "gpipe", 2),
                    "p4": (Mesh.of(pp=4, dp=1), "1f1b", 4)}  # mesh, schedule, micro-batches per replica


@pytest.mark.ray
def test_pipeline_parallel_training_matches_the_single_process_reference_across_a_checkpoint(
        ray_cluster, model_dir, reference, tmp_path):
    """Pipeline stages with tensor or data parallelism, or alone, on 4 ranks: the reference's losses and weights
    after three steps, and its next two steps again after loading the checkpoint saved before them; and its three
    steps taken by one process, the pipeline and one process again, each continuing the last one's training state
    (the path ``Lab.reconfigure`` takes)."""
    losses, weights, later = reference
    meshes = {name: mesh for name, (mesh, _, _) in PIPELINE_LAYOUTS.items()}
    group = WorkerGroup(Role(PipelineEngineProbe, model_dir), ResourcePool(4), meshes=meshes, name="pp-engine")
    try:
        for layout, (_, schedule, micro_batches) in PIPELINE_LAYOUTS.items():
            group.start(layout, schedule, micro_batches)
            assert group.train(sequences(), 3) == [pytest.approx(losses, rel=1e-5)] * 4, layout
            for rank_weights in group.weights():
                assert rank_weights.keys() == weights.keys(), layout
                for name, value in weights.items():
                    diff = (rank_weights[name] - value).abs()  # as the other engines' (Adam and rounding noise)
                    assert diff.max() < 1e-3 and diff.mean() < 1e-5, f"{layout}: {name}"
            trained = load_causal_lm(model_dir)
            trained.load_state_dict(rank_weights)
            expected = response_log_probs(trained, sequences(seed=2))[0].detach()
            for log_probs in group.log_probs(sequences(seed=2), 3):  # micro-batches of 3, 3 and 2 rows
                torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5, msg=layout)
            checkpoint = tmp_path / layout.replace(" ", "")
            group.save_checkpoint(str(checkpoint))
            assert group.train(sequences(seed=1), 2) == [pytest.approx(later, rel=1e-5)] * 4, layout
            group.load_checkpoint(str(checkpoint))
            assert group.train(sequences(seed=1), 2) == [pytest.approx(later, rel=1e-5)] * 4, layout
        # the training state moves into and out of the pipeline: one process, then p2 t2, then one process again
        seen, state = [], None
        for hop in ("torch", "p2 t2", "torch"):
            if hop == "torch":
                single = WorkerGroup(Role(EngineProbe, model_dir, "torch", micro_batches=4, state=state),
                                     backend="local", name="hop-torch")
                seen += single.train(sequences(), steps=1).meta["losses"]
                state = single.training_state()[0]
                single.shutdown()
            else:
                group.start(hop, "1f1b", 4, state)
                seen += group.train(sequences(), 1)[0]
                state = group.training_state()[0]
        assert seen == pytest.approx(losses, rel=1e-5)
    finally:
        group.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])  # ZeRO-1 steps with ZeRO-2's optimizer
def test_deepspeed_stops_a_step_whose_gradient_norm_is_not_finite_before_the_weights(ray_cluster, model_dir, stage):
    group = WorkerGroup(Role(EngineProbe, model_dir, "deepspeed", zero_stage=stage), ResourcePool(2),
                        name=f"nan-grad-{stage}")
    before = group.weights()[0]
    failed = group.train_with_nan_gradient(sequences(), rank=1).meta  # finite loss, NaN gradient on rank 1 only
    assert "grad_norm is inf" in failed["error"] and "the step was not applied" in failed["error"]
    after = group.weights()[0]
    assert all(torch.equal(after[name], value) for name, value in before.items())
    group.train(sequences(), steps=1)  # DeepSpeed dropped the step cleanly: the next one applies
    assert not all(torch.equal(group.weights()[0][name], value) for name, value in before.items())
    group.shutdown()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_gradient_bucket_is_no_larger_than_the_model(ray_cluster, model_dir, stage):
    # the H200 smoke run measured a 0.8M-parameter actor's update at a 1995 MiB peak, 1907 MiB of it
    # DeepSpeed's default 5e8-element bucket: memory the colocated models on the GPU could not have
    with WorkerGroup(Role(EngineProbe, model_dir, "deepspeed", zero_stage=stage), ResourcePool(2),
                     name=f"bucket-{stage}") as group:
        group.train(sequences(), steps=1)
        sizes = group.gradient_bucket()
    assert sizes[0] == sizes[1] and 0 < sizes[0]["bucket"] <= sizes[0]["parameters"]


def test_the_torch_engine_honours_bf16_with_autocast_over_float32_weights(model_dir, reference):
    """bf16 used to be dropped silently by the torch engine: its losses were the float32 ones, bit for bit."""
    group = WorkerGroup(Role(EngineProbe, model_dir, "torch", micro_batches=4, bf16=True), backend="local")
    losses = group.train(sequences(), steps=3).meta["losses"]
    weights = group.weights()[0]
    group.shutdown()
    expected_losses, expected_weights, _ = reference
    assert losses != expected_losses  # the forward ran in bfloat16
    assert losses == pytest.approx(expected_losses, rel=2e-2)
    assert {w.dtype for w in weights.values()} == {torch.float32}  # master weights stay float32
    # Adam moves an element whose gradient is near zero by about lr either way, so single elements
    # may differ by several lr, by as much as the CPU's bf16 kernels round; the whole must stay close
    initial = load_causal_lm(model_dir).state_dict()
    trained = sum((expected_weights[name] - initial[name]).abs().sum() for name in weights)
    apart = sum((weight - expected_weights[name]).abs().sum() for name, weight in weights.items())
    assert apart < 0.1 * trained  # 0.037 on an AVX-512 CPU with native bf16


def test_the_cpu_optimizer_is_fused_adamw_and_steps_as_the_default_one():
    """Fused AdamW on the CPU (one pass per tensor, not one per temporary) takes the same steps as torch's default."""
    config = OptimConfig(lr=0.01, weight_decay=0.1)
    start = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    fused, default = (torch.nn.Parameter(start.clone()) for _ in range(2))
    optimizer = build_optimizer(iter([fused]), config, "cpu")
    reference = torch.optim.AdamW([default], lr=0.01, weight_decay=0.1)
    assert optimizer.defaults["fused"] and not build_optimizer(iter([default]), config, "cuda:0").defaults["fused"]
    for step in range(5):
        gradient = torch.randn(1000, generator=torch.Generator().manual_seed(step + 1))
        fused.grad, default.grad = gradient.clone(), gradient.clone()
        optimizer.step()
        reference.step()
    assert (fused - start).abs().mean() > 0.01  # the steps moved the weights
    torch.testing.assert_close(fused, default, rtol=0, atol=1e-6)


def test_schedule_warms_up_then_decays():
    param = torch.nn.Parameter(torch.zeros(1))
    config = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    optimizer = build_optimizer(iter([param]), config, "cpu")
    scheduler = build_scheduler(optimizer, config)
    seen = []
    for _ in range(7):
        seen.append(round(optimizer.param_groups[0]["lr"], 4))
        optimizer.step()
        scheduler.step()
    assert seen == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    with pytest.raises(ValueError, match=r"needs optim.total_steps"):
        OptimConfig(schedule="cosine")


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_moves_between_engines_and_layouts_without_losing_a_step(ray_cluster, model_dir, reference):
    """One optimizer step in each of: one torch process, ZeRO-3 on 2 ranks, FSDP on 2 ranks, each starting from the
    last one's ``training_state``: the same losses and weights as one process taking all three steps."""
    losses, weights, _ = reference
    hops = [({"backend": "local"}, "torch", 0, 4), ({}, "deepspeed", 3, 2), ({}, "fsdp", 0, 2)]
    state, seen = None, []
    for options, backend, stage, micro_batches in hops:
        group = WorkerGroup(Role(EngineProbe, model_dir, backend, zero_stage=stage, micro_batches=micro_batches,
                                 state=state), ResourcePool(1 if options else 2), name=f"hop-{backend}", **options)
        try:
            seen += group.train(sequences(), steps=1).meta["losses"]
            state = group.training_state()[0]
        finally:
            group.shutdown()
    assert seen == pytest.approx(losses, rel=1e-5)
    assert state.global_step == 3 and set(state.moments) == set(weights)
    for name, value in weights.items():
        diff = (state.weights[name] - value).abs()
        assert diff.max() < 1e-3 and diff.mean() < 1e-5, name
