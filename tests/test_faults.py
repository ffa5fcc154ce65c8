"""Faults injected for real: worker processes killed mid-stage, failed and damaged checkpoints."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import signal
import time
from pathlib import Path

import pytest
import torch

from hybridflow_lab.controller import WorkerCallError, WorkerCallTimeout
from hybridflow_lab.controller.interrupts import interrupts_held
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer import checkpointing
from hybridflow_lab.trainer.checkpointing import CheckpointError
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_stages import TRAINING_COLUMNS
from hybridflow_lab.workers.reward_guard import RewardFunctionError, RewardGuard

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


MODEL_SEED = 5  # conftest's model_dir builds this module's tiny model with it


def run_overrides(model_dir, run_dir, backend="ray", *extra):
    return (f"backend={backend}", f"actor.model_path={model_dir}", "actor.ranks=2", "actor.engine.backend=torch",
            "actor.optim.lr=1e-3", f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.save_every=2",
            "batch.rollout_batch_prompts=4", "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=8",
            "batch.micro_batch_sequences_per_rank=4", "task.eval_size=8", "rollout.max_new_tokens=5", *extra)


def on_dispatch(lab: Lab, method: str, action) -> None:
    """Run ``action()`` once, right after the controller has handed ``method`` to the actor's ranks."""
    actor = lab.actor

    def listener(spans):
        if any(s.phase == Phase.DISPATCH and s.name == method and s.group == actor.name for s in spans):
            unsubscribe()
            action()

    unsubscribe = lab.telemetry.subscribe(listener)


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt, as in a notebook kernel, even when the test runner was started in the
    background (where the shell makes the process ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def still_hosting_a_rank(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are live processes hosting a worker rank (Ray names them after the actor class; a
    zombie's command line is empty)."""
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # the process has ended
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RankHost"):
                alive.add(pid)
    return alive


@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_killed_mid_stage_is_named_and_the_run_recovers_from_its_checkpoint(ray_cluster, model_dir,
                                                                                     tmp_path):
    straight = Lab("arithmetic_grpo", overrides=run_overrides(model_dir, tmp_path / "straight"))
    expected = straight.run(4)[2:]
    straight.shutdown()

    lab = Lab("arithmetic_grpo", overrides=run_overrides(model_dir, tmp_path / "faulty"))
    lab.run(2)  # checkpoint at step 2
    for method in ("generate_sequences", "update_actor"):
        pid = lab.actor.pids()[1]
        on_dispatch(lab, method, lambda pid=pid: os.kill(pid, signal.SIGKILL))
        with pytest.raises(WorkerCallError) as failure:  # a hang in a collective would meet pytest's timeout
            lab.step()
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


@pytest.mark.ray
def test_a_stage_whose_rank_hangs_raises_within_its_timeout_naming_the_stage_the_group_and_the_rank(
        ray_cluster, model_dir, tmp_path):
    """A rank process stopped (SIGSTOP: alive, never answering) while the actor computes log-probs: the stage
    raises once ``trainer.stage_timeout_s`` has passed, naming the stage, the group and the silent rank, instead
    of hanging the notebook."""
    lab = Lab("arithmetic_grpo", overrides=run_overrides(model_dir, tmp_path / "run", "ray", "actor.ranks=1",
                                                          "trainer.stage_timeout_s=5"))
    try:
        batch = lab.generate(lab.next_prompts())
        pid = lab.actor.pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(WorkerCallTimeout) as hung:
                lab.old_log_prob(batch)
        finally:
            os.kill(pid, signal.SIGCONT)
        error = hung.value
        assert (error.group, error.method, error.still_running) == (lab.actor.name, "compute_log_prob", (0,))
        assert "rank 0 did not answer 'compute_log_prob' within 5 s" in str(error)
        assert any(note.startswith("in the Lab's 'old_log_prob' stage") for note in error.__notes__)
    finally:
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


def troublesome_reward(prompt: str, response: str, truth: object) -> float:
    """A user's reward function with one bug of each kind, chosen by the response."""
    if response == "raise":
        raise ValueError("cannot parse")
    if response == "nan":
        return math.nan
    if response == "hang":
        time.sleep(600)
    if response == "exit":
        os._exit(3)
    return float(len(response))


ROWS = [("p", response, "t") for response in ("ab", "raise", "nan", "hang", "abc", "exit", "abcd")]


def test_the_zero_policy_scores_bad_rows_zero_counts_them_and_stops_a_hung_function():
    scores, counts = RewardGuard("zero", timeout_s=1.0).scores(troublesome_reward, ROWS)  # "hang" never returns
    assert scores == [2.0, 0.0, 0.0, 0.0, 3.0, 0.0, 4.0]
    assert counts == {"errors": 2, "nonfinite": 1, "timeouts": 1}  # raise and exit; nan; hang


@pytest.mark.parametrize(("response", "problem"), [
    ("raise", "raised ValueError: cannot parse"), ("nan", "returned nan"),
    ("hang", r"did not return within task.reward_timeout_s=0.5 s"), ("exit", r"ended its process \(exit code 3\)")])
def test_the_fail_policy_shows_the_row_and_the_setting_to_change(response, problem):
    rows = [("p", "ok", "t"), ("12+3=", response, "15")]
    with pytest.raises(RewardFunctionError, match=f"'troublesome_reward' {problem} on row 1: prompt '12\\+3=', "
                       f"response '{response}', ground truth '15'; .*task.reward_on_error=zero"):
        RewardGuard("fail", timeout_s=0.5).scores(troublesome_reward, rows)


def test_the_lab_counts_rows_its_reward_function_could_not_score(model_dir, tmp_path):
    overrides = (*one_rank_overrides(model_dir, tmp_path / "run"), "task.reward_on_error=zero")
    lab = Lab("arithmetic_grpo", overrides=overrides)
    lab.task.reward = lambda prompt, response, truth: math.inf if len(response) % 2 else 1.0
    metrics = lab.step()
    lengths = [len(text) for text in lab.last_batch["response_text"]]
    assert metrics["reward/nonfinite"] == sum(n % 2 for n in lengths) and metrics["reward/errors"] == 0
    assert lab.last_batch["scores"].tolist() == [0.0 if n % 2 else 1.0 for n in lengths]
    lab.shutdown()


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nonfinite_update_never_reaches_the_weights(model_dir, tmp_path, policy):
    overrides = (*one_rank_overrides(model_dir, tmp_path / "run"), f"trainer.on_nonfinite={policy}")
    lab = Lab("arithmetic_grpo", overrides=overrides)
    lab.step()
    batch = lab.last_batch.select(*TRAINING_COLUMNS, "advantages")
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(0))
    before = lab.old_log_prob(batch)["old_log_probs"]
    poisoned = batch.select(*batch.keys())
    poisoned["advantages"] = torch.full_like(batch["advantages"], math.nan)
    if policy == "stop":
        with pytest.raises(WorkerCallError, match=r"NonFiniteUpdate: .*pg_loss is nan.* was not applied") as failure:
            lab.update_actor(poisoned)
        assert any("'update_actor' stage" in note for note in failure.value.__notes__)
    else:
        assert lab.update_actor(poisoned)["actor/nonfinite_skipped"] == 1.0
    assert torch.equal(lab.old_log_prob(batch)["old_log_probs"], before)  # weights and optimizer untouched
    assert lab.update_actor(batch)["actor/nonfinite_skipped"] == 0.0  # and the next update applies
    assert not torch.equal(lab.old_log_prob(batch)["old_log_probs"], before)
    lab.shutdown()


def test_an_interrupt_during_submission_is_held_until_the_block_ends(interruptible):
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler has run by now; the block goes on
        finished.append(True)
    assert finished == [True]


@pytest.mark.ray
@pytest.mark.slow
def test_an_interrupted_stage_leaves_the_lab_usable_and_rebuilding_it_replaces_its_workers(ray_cluster, model_dir,
                                                                                          tmp_path, interruptible):
    overrides = run_overrides(model_dir, tmp_path / "run", "ray", "trainer.save_every=0")
    lab = Lab("arithmetic_grpo", overrides=overrides)
    lab.step()
    on_dispatch(lab, "update_actor", lambda: os.kill(os.getpid(), signal.SIGINT))  # the kernel's interrupt
    with pytest.raises(KeyboardInterrupt):
        lab.step()
    assert lab.step_index == 1
    assert math.isfinite(lab.step()["actor/pg_loss"]) and lab.step_index == 2  # the step restarts and completes
    old_groups = list(lab.groups.values())
    pids = {pid for group in old_groups for pid in group.pids()}
    rebuilt = Lab("arithmetic_grpo", overrides=overrides)  # re-running the notebook cell that built it
    assert all(group.closed for group in old_groups)
    pids |= {pid for group in rebuilt.groups.values() for pid in group.pids()}
    rebuilt.step()
    rebuilt.shutdown()
    deadline = time.monotonic() + 30
    while still_hosting_a_rank(pids) and time.monotonic() < deadline:  # killed actors exit asynchronously
        time.sleep(0.5)
    assert still_hosting_a_rank(pids) == set()  # the first Lab's ranks went with its rebuild, the second's with it
