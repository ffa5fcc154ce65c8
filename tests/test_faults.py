"""Faults injected for real: worker processes killed mid-stage, failed and damaged checkpoints."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import time

import pytest
import ray

from hybridflow_lab.controller import WorkerCallError
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer import checkpointing
from hybridflow_lab.trainer.checkpointing import CheckpointError
from hybridflow_lab.trainer.lab import Lab

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_model_dir(tmp_path_factory.mktemp("faults") / "m", "tiny", "qwen2", seed=5))


def run_overrides(model_dir, run_dir, backend="ray", *extra):
    return (f"backend={backend}", f"actor.model_path={model_dir}", "actor.ranks=2", "actor.engine.backend=torch",
            "actor.optim.lr=1e-3", f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.save_every=2",
            "batch.rollout_batch_prompts=4", "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=8",
            "batch.micro_batch_sequences_per_rank=4", "task.eval_size=8", "rollout.max_new_tokens=5", *extra)


def kill_rank_when_dispatched(lab: Lab, method: str, rank: int) -> None:
    """SIGKILL ``rank``'s process of the actor group right after the controller submits ``method`` to it."""
    actor = lab.actor
    pid = ray.get(actor._backend.actors[rank].__ray_call__.remote(lambda host: os.getpid()))

    def listener(spans):
        if any(s.phase == Phase.DISPATCH and s.name == method and s.group == actor.name for s in spans):
            unsubscribe()
            os.kill(pid, signal.SIGKILL)

    unsubscribe = lab.telemetry.subscribe(listener)


@pytest.mark.slow
def test_a_worker_killed_mid_stage_is_named_and_the_run_recovers_from_its_checkpoint(ray_cluster, model_dir,
                                                                                     tmp_path):
    straight = Lab("arithmetic_grpo", overrides=run_overrides(model_dir, tmp_path / "straight"))
    expected = straight.run(4)[2:]
    straight.shutdown()

    lab = Lab("arithmetic_grpo", overrides=run_overrides(model_dir, tmp_path / "faulty"))
    lab.run(2)  # checkpoint at step 2
    for method in ("generate_sequences", "update_actor"):
        kill_rank_when_dispatched(lab, method, rank=1)
        started = time.monotonic()
        with pytest.raises(WorkerCallError) as failure:
            lab.step()
        assert time.monotonic() - started < 60  # reported, not hung in a collective
        error = failure.value
        assert (error.group, error.role, error.rank, error.method) == (lab.actor.name, "actor_worker", 1, method)
        assert "the worker process died" in str(error)
        assert any("lab.recover()" in note and "step 2" in note for note in error.__notes__)
        assert lab.recover() == 2
    resumed = lab.run(2)
    for got, want in zip(resumed, expected, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
    logged = [json.loads(line)["step"] for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4] and [m["step"] for m in lab.history] == [1, 2, 3, 4]
    lab.shutdown()


def test_recover_without_a_checkpoint_restarts_from_step_zero(model_dir, tmp_path):
    overrides = run_overrides(model_dir, tmp_path / "run", "local", "trainer.save_every=0", "actor.ranks=1")
    lab = Lab("arithmetic_grpo", overrides=overrides)
    first = lab.step()
    assert lab.recover() == 0 and lab.history == [] and checkpointing.latest(tmp_path / "run") is None
    again = lab.step()
    for key in COMPARED:
        assert again[key] == pytest.approx(first[key], rel=1e-6), key
    lab.shutdown()


def one_rank_overrides(model_dir, run_dir):
    return run_overrides(model_dir, run_dir, "local", "trainer.save_every=0", "actor.ranks=1")


def test_a_write_failure_while_saving_keeps_the_previous_checkpoint(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=one_rank_overrides(model_dir, tmp_path / "run"))
    lab.step()
    first = lab.save()
    lab.step()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # the 3 MB weights file cannot be written
    try:
        with pytest.raises(WorkerCallError) as failure:
            lab.save()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.strerror(errno.EFBIG) in str(failure.value)  # what a full disk looks like to the writer
    assert any(f"{first} is intact" in note for note in failure.value.__notes__)
    assert checkpointing.latest(tmp_path / "run") == first
    assert sorted(p.name for p in first.parent.iterdir()) == ["latest", "step_000001"]  # nothing half-written
    assert lab.load() == 1
    lab.shutdown()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_checkpoint_is_named_on_load(model_dir, tmp_path, damage):
    lab = Lab("arithmetic_grpo", overrides=one_rank_overrides(model_dir, tmp_path / "run"))
    lab.step()
    first = lab.save()
    lab.step()
    second = lab.save()
    weights = second / "actor" / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        weights.unlink()
    problem = {"truncate": f"has {len(data) // 2} bytes, {len(data)} were written",
               "flip": "is not the file that was written", "delete": "actor/model.safetensors is missing"}[damage]
    with pytest.raises(CheckpointError, match=f"{second} is damaged: .*{problem}.*load an earlier one: step_000001"):
        lab.load()
    assert lab.load(first) == 1
    lab.shutdown()
