"""Overlapped steps: stages on different pools run at once, colocated ones take turns, the numbers do not change."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridflow_lab.dataflows.pending import PendingBatch, StageFuture, StageNotRun, StageTimeout
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.ui.figures import timeline

MODEL_SEED = 11  # conftest's model_dir builds this module's tiny model with it


def ppo_overrides(model_dir, run_dir, critic_pool, *extra):
    return ("backend=ray", f"actor.model_path={model_dir}", "algorithm.name=ppo", "actor.ranks=1", "critic.ranks=1",
            f"critic.pool={critic_pool}", "actor.engine.backend=torch", "critic.engine.backend=torch",
            "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", "algorithm.kl_loss_coef=0.01", "algorithm.lam=0.95",
            "algorithm.entropy_coef=0.01",
            f"trainer.run_dir={run_dir}", "trainer.progress=false", "batch.rollout_batch_prompts=16",
            "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=64",
            "batch.micro_batch_sequences_per_rank=16",
            "rollout.max_new_tokens=24", "task.eval_size=8", "seed=3", *extra)


def stage_spans(lab, step):
    return {s.name: s for s in lab.telemetry.spans(phase=Phase.STAGE) if s.step == step}


def overlapping(a, b):
    return a.t_start < b.t_end and b.t_start < a.t_end


def learned(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


@pytest.mark.ray
@pytest.mark.slow
def test_an_overlapped_ppo_step_gives_the_metrics_of_the_sequential_one(ray_cluster, model_dir, tmp_path):
    """Actor and critic on pools of their own: the critic's values run beside the reference pass and its update
    beside the actor's, and every learned number (losses, gradient norms, KL, scores) is bit-equal to the same
    seed's steps run one stage at a time."""
    histories = {}
    for overlap in (False, True):
        lab = Lab("arithmetic_grpo", overrides=ppo_overrides(model_dir, tmp_path / str(overlap), "critic",
                                                             f"trainer.overlap={str(overlap).lower()}"))
        try:
            histories[overlap] = [learned(m) for m in lab.run(2)]
            summaries = {s.stage: s for s in lab.stage_summaries}
            steps = [stage_spans(lab, step) for step in (0, 1)]
            together = [overlapping(spans["values"], spans["ref"]) for spans in steps]
            if overlap:  # on lanes of their own; whether they overlapped in time is up to the machine's load
                spans = steps[1]
                assert (spans["values"].attrs["lane"], spans["ref"].attrs["lane"]) == ("pool critic", "pool main")
                rows = {row for bar in timeline(list(spans.values())).data for row in bar.y}
                assert {"controller (pool critic)", "controller (pool main)"} <= rows
            else:
                assert all(not s.concurrent for s in summaries.values()) and not any(together)
        finally:
            lab.shutdown()
    assert histories[True] == histories[False]
    last = histories[True][1]
    assert "critic/vf_loss" in last and last["actor/grad_norm"] > 0 and last["actor/kl"] != 0  # it learned


@pytest.mark.ray
@pytest.mark.slow
def test_colocated_roles_take_turns_and_failures_name_their_stage(ray_cluster, model_dir, tmp_path):
    """The critic on the actor's pool: no two of their stages overlap. A stage that fails stops the stages that
    read it, and the step raises the failure itself; reading a column no stage produced names the reader."""
    lab = Lab("arithmetic_grpo", overrides=ppo_overrides(model_dir, tmp_path / "run", "main"))
    try:
        lab.step()
        spans = stage_spans(lab, 0)
        pool_stages = [spans[name] for name in ("generate", "ref", "values", "update_critic", "update_actor")]
        for a in pool_stages:
            for b in pool_stages:
                assert a is b or not overlapping(a, b), (a.name, b.name)

        with pytest.raises(KeyError, match="'old_log_prob' stage reads"), lab.overlapped():
            after = lab.advantages(lab.old_log_prob(lab.next_prompts()))  # prompts have no responses yet
        with pytest.raises(StageNotRun, match=r"the 'old_log_prob' stage of step 1 failed"):
            after["old_log_probs"]
        with pytest.raises(StageNotRun, match=r"the 'adv' stage of step 1 failed .*'adv' stage reads columns "
                                              r"\['response_mask', 'uid', 'scores'\]: .*'response_mask'"):
            after["advantages"]  # its reads name what is missing
        with pytest.raises(KeyError, match=r"'update_critic' stage reads .*'values'"), lab.overlapped():
            batch = lab.reward(lab.generate(lab.next_prompts()))
            lab.update_critic(batch)
    finally:
        lab.shutdown()


def test_stages_on_other_lanes_run_side_by_side_and_a_lane_runs_its_stages_in_call_order():
    """Deterministic, whatever the load: the critic lane's stage can only finish once the main lane's has started,
    which it could not if the lanes took turns; what overlapped is what ``StageSummary.concurrent`` reports."""
    from hybridflow_lab.telemetry.stage_summary import StageSummary
    from hybridflow_lab.trainer.scheduler import StageRun, StageScheduler, concurrent_stages

    scheduler, started, order = StageScheduler("t"), threading.Event(), []
    values, ref, update = (StageFuture(name, 0, "test", 60) for name in ("values", "ref", "update_actor"))
    try:
        scheduler.submit("pool critic", values, lambda: started.wait(30))
        scheduler.submit("pool main", ref, lambda: (started.set(), order.append("ref")))
        scheduler.submit("pool main", update, lambda: order.append("update_actor"))
        scheduler.drain()
        assert values.result() is True and order == ["ref", "update_actor"]
    finally:
        scheduler.close()
    runs = [StageRun("values", 0, "pool critic", 1.0, 3.0), StageRun("ref", 0, "pool main", 2.0, 2.5),
            StageRun("update_actor", 0, "pool main", 2.5, 4.0), StageRun("adv", 0, "controller", 4.0, 4.1)]
    assert concurrent_stages(runs) == {"values": ["ref", "update_actor"], "ref": ["values"],
                                       "update_actor": ["values"], "adv": []}
    summary = StageSummary("update_actor", 0, 1.5, concurrent=["values"])
    assert summary.headline().endswith("alongside values")


def test_a_pending_batch_waits_only_for_the_stage_that_writes_a_column():
    base = DataBatch({"input_ids": torch.ones(2, 3, dtype=torch.long)}, {"uid": [0, 1]})
    values: StageFuture[DataBatch] = StageFuture("values", 0, "pool critic", 60)
    pending = PendingBatch(base, values, writes=("values",))
    assert torch.equal(pending["input_ids"], base["input_ids"]) and len(pending) == 2  # without waiting
    assert "values" in pending and "returns" not in pending and not pending.done()
    with pytest.raises(KeyError, match=r"no stage up to 'values'.*'returns'"):
        pending["returns"]
    got = []
    reader = threading.Thread(target=lambda: got.append(pending["values"]))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # waits for the stage
    values.run(lambda: DataBatch({"values": torch.full((2, 3), 0.5)}))
    reader.join(5)
    assert torch.equal(got[0], torch.full((2, 3), 0.5))
    pending["advantages"] = torch.zeros(2, 3)
    assert sorted(pending.result().keys()) == ["advantages", "input_ids", "uid", "values"]


def test_reading_the_output_of_a_failed_stage_raises_stage_not_run_naming_it():
    failed: StageFuture[DataBatch] = StageFuture("ref", 4, "pool main", 60)
    failed.run(lambda: 1 / 0)
    with pytest.raises(StageNotRun, match=r"'ref' stage of step 4 failed \(ZeroDivisionError"):
        PendingBatch(DataBatch(non_tensors={"uid": [0]}), failed, writes=("ref_log_probs",))["ref_log_probs"]


def test_a_wait_for_a_stage_running_past_its_timeout_raises_naming_the_stage_and_its_lane():
    """A stage that never finishes (a controller function stuck, a rank that never answers) ends the waits for
    it: ``StageTimeout`` once it has run its timeout, where a wait without one would hang the notebook."""
    release = threading.Event()
    stuck: StageFuture[DataBatch] = StageFuture("reward", 2, "controller", timeout_s=1.0)
    worker = threading.Thread(target=stuck.run, args=(lambda: release.wait(60),))
    worker.start()
    try:
        with pytest.raises(StageTimeout, match=r"'reward' stage of step 2 \(controller\) did not finish within "
                                               r"trainer.stage_timeout_s=1 s"):
            PendingBatch(DataBatch(non_tensors={"uid": [0]}), stuck, writes=("scores",))["scores"]
    finally:
        release.set()
        worker.join()


def test_a_stage_with_optional_reads_is_queued_without_waiting_for_the_stage_that_makes_its_batch():
    """Calling a stage that reads columns the batch may have (``optional``) returns at once: the stage making the
    batch declared what it writes, so the dataflow goes on calling the next stages while it runs."""
    from hybridflow_lab.dataflows import StepContext
    from hybridflow_lab.telemetry import TelemetryStore
    from hybridflow_lab.trainer.stage_runner import StageRunner, lane_of
    from hybridflow_lab.trainer.stages import Stage

    runner, step, release = StageRunner("t", TelemetryStore(), lambda error, stage: None, 60), StepContext(0, 0), \
        threading.Event()

    def generate(_):
        assert release.wait(30)
        return DataBatch({"scores": torch.ones(2)})

    def advantages(rows):
        return DataBatch({"advantages": rows["scores"] * (2 if "values" in rows else 1)})

    try:
        with runner.overlapped():
            made = runner.batch_stage(Stage.GENERATE, step, lane_of("rollout"), None, generate, writes=("scores",))
            added = runner.batch_stage(Stage.ADV, step, lane_of(None), made, advantages, ("scores",),
                                       ("advantages",), optional=("values",))
            queued_before_generation_ended = not release.is_set()
            release.set()
        assert queued_before_generation_ended and added["advantages"].tolist() == [1.0, 1.0]
    finally:
        runner.close()
