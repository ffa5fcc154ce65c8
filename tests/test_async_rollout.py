"""A rollout group of its own: fed the actor's weights after each update, and running ahead of training by at most
``rollout.max_staleness`` policy versions, with each batch's staleness reported and corrected for."""

from __future__ import annotations

import numpy as np
import pytest

from hybridflow_lab.dataflows.pending import resolve
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.trainer.lab import Lab

MODEL_SEED = 11  # conftest's model_dir builds this module's tiny model with it


def grpo_overrides(model_dir, run_dir, *extra):
    return ("backend=ray", f"actor.model_path={model_dir}", "algorithm.name=grpo", "actor.ranks=1",
            "actor.engine.backend=torch", "actor.optim.lr=1e-3", "algorithm.entropy_coef=0.01",
            f"trainer.run_dir={run_dir}", "trainer.progress=false", "batch.rollout_batch_prompts=8",
            "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=32",
            "batch.micro_batch_sequences_per_rank=16", "rollout.max_new_tokens=16", "task.eval_size=8", "seed=5",
            *extra)


def learned(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/", "rollout/sync"))}


def spans_named(lab, name):
    return [s for s in lab.telemetry.spans(phase=Phase.STAGE) if s.name == name]


@pytest.mark.ray
@pytest.mark.slow
def test_an_on_policy_rollout_group_learns_what_the_hybrid_engine_does(ray_cluster, model_dir, tmp_path):
    """Staleness 0 with generation on a pool of its own: the weights reach it after every update (timed, every byte
    of the policy, fingerprinted), every batch is zero versions old, and the learned numbers equal those of the
    actor generating on its own ranks."""
    histories = {}
    for pool in ("", "rollout"):
        lab = Lab("arithmetic_grpo", overrides=grpo_overrides(model_dir, tmp_path / (pool or "hybrid"),
                                                              f"rollout.pool='{pool}'"))
        try:
            histories[pool] = [learned(m) for m in lab.run(2)]
            if pool:
                weight_bytes = sum(t.nbytes for t in lab.actor.policy_weights()[0].values())
                assert [m["rollout/sync_bytes"] for m in lab.history] == [weight_bytes] * 2
                assert all(m["rollout/sync_s"] > 0 for m in lab.history)
                # step 0 loads version 0, then version 1 after its update: step 1 generates with it
                assert [s.step for s in spans_named(lab, "sync_weights")][:2] == [0, 0]
                assert lab.policy_version == 2
        finally:
            lab.shutdown()
    assert [m["rollout/staleness_max"] for m in histories["rollout"]] == [0, 0]
    assert histories["rollout"] == histories[""]


@pytest.mark.ray
@pytest.mark.slow
def test_generation_runs_ahead_by_at_most_max_staleness_and_the_stale_batches_are_weighted(ray_cluster, model_dir,
                                                                                             tmp_path):
    """``rollout.max_staleness=2``: steps 1 and 2 train on responses generated while step 0 trained, so they are 1
    and 2 versions old, and no batch is older than 2. Truncated importance sampling is on by default for them
    (``rollout_is=auto``): the weights move away from 1 as the policy moves away from the one that sampled. A
    checkpoint taken with batches in flight resumes from the first prompts not trained on, and so does a Lab
    reconfigured to another staleness (its groups restart, and what was generated ahead is generated again)."""
    lab = Lab("arithmetic_grpo", overrides=grpo_overrides(model_dir, tmp_path / "run", "rollout.pool=rollout",
                                                          "rollout.max_staleness=2"))
    try:
        history = lab.run(4)
        assert [m["rollout/staleness_max"] for m in history] == [0, 1, 2, 2]
        assert [m["rollout/staleness_min"] for m in history] == [0, 1, 2, 2]
        fresh, stale = history[0], history[3]
        assert fresh["actor/rollout_mismatch"] < 1e-4 and fresh["actor/rollout_is_weight"] == pytest.approx(1, abs=1e-4)
        assert stale["actor/rollout_mismatch"] > 100 * max(fresh["actor/rollout_mismatch"], 1e-6)
        assert stale["actor/rollout_is_weight"] != pytest.approx(1, abs=1e-4)

        # the rollout group runs its calls in order: step 0's update reached it (the second weight load) only after
        # step 2's responses were generated; whether they overlapped the update in time is up to the machine's load
        ahead = next(g for g in spans_named(lab, "generate") if g.step == 2)
        loads = sorted(spans_named(lab, "sync_weights"), key=lambda span: span.t_start)
        assert loads[1].t_start >= ahead.t_end

        queued = np.unique(resolve(lab.rollouts_ahead.queue[0][1])["uid"])  # the next step's prompts, generated ahead
        checkpoint = lab.save()
        lab.load(checkpoint)
        assert lab.policy_version == 4 and not lab.rollouts_ahead.queue
        np.testing.assert_array_equal(lab.next_prompts()["uid"], queued)

        lab.step()  # queues steps 5 and 6
        queued = np.unique(resolve(lab.rollouts_ahead.queue[0][1])["uid"])
        lab.reconfigure("rollout.max_staleness=1")  # restarts the groups: what was generated ahead is drawn again
        assert lab.rollouts_ahead.depth == 1 and not lab.rollouts_ahead.queue
        np.testing.assert_array_equal(lab.next_prompts()["uid"], queued)
    finally:
        lab.shutdown()
