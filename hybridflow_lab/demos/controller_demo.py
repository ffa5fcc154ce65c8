"""The controller demo: two worker groups, one with two colocated roles, one dataflow.

    policy group  (pool of 4 slots, mesh rollout = dp 2 x tp 2)
        rollout.generate   MESH("rollout"): each dp pair gets half the prompts, tp ranks all-reduce
        reference.log_prob DP_COMPUTE over the 4 ranks, in the same processes as the rollout
    reward group  (its own pool of 2 slots)
        reward.score       DP_COMPUTE, reading the rollout's output straight from the policy ranks
"""

from __future__ import annotations

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Mesh, ResourcePool, Role, WorkerGroup, init_cluster
from hybridflow_lab.demos.toy_workers import ToyReference, ToyReward, ToyRollout, greedy_extend, toy_weight
from hybridflow_lab.telemetry import Phase, TelemetryStore, span_table

PROMPTS = ["hello", "ray", "actor", "critic", "reward", "policy", "value", "token"]


def build_groups(backend: str = "ray", telemetry: TelemetryStore | None = None) -> tuple[WorkerGroup, WorkerGroup]:
    """The policy group (rollout + reference colocated) and the reward group, on separate pools.

    The local backend runs ranks one after another in this process, so collectives are out:
    there the policy group has a single rank (dp 1 x tp 1), which a debugger can step into.
    """
    mesh = Mesh.of(dp=2, tp=2) if backend == "ray" else Mesh.of(dp=1, tp=1)
    policy = WorkerGroup(
        {"rollout": Role(ToyRollout, seed=0), "reference": Role(ToyReference, seed=0)},
        ResourcePool(mesh.size, name="policy"), name="policy", backend=backend,
        meshes={"rollout": mesh}, telemetry=telemetry,
    )
    reward = WorkerGroup(ToyReward, ResourcePool(2, name="reward"), name="reward", backend=backend,
                         telemetry=telemetry)
    return policy, reward


def dataflow(policy: WorkerGroup, reward: WorkerGroup, prompts: DataBatch) -> DataBatch:
    """One pass of the toy RLHF dataflow; the rollout's future feeds both consumers."""
    responses = policy.rollout.generate(prompts)  # non-blocking: a DataBatchFuture
    scores = reward.score(responses)
    log_probs = policy.reference.log_prob(responses)
    return responses.get().union(scores).union(log_probs)


def main(backend: str = "ray") -> DataBatch:
    if backend == "ray":
        init_cluster()
    telemetry = TelemetryStore()
    policy, reward = build_groups(backend, telemetry)
    try:
        prompts = DataBatch(non_tensors={"prompt": PROMPTS})
        telemetry.step = 0
        result = dataflow(policy, reward, prompts)
    finally:
        policy.shutdown()
        reward.shutdown()
    expected = greedy_extend(PROMPTS, lambda x: x @ toy_weight(0).T, 6)
    assert [p + r for p, r in zip(result["prompt"], result["response"], strict=True)] == expected, "TP mismatch"
    print(result.to_pandas().to_string())
    print("\nper-rank execution spans (ms):")
    table = span_table(s for s in telemetry.spans() if s.phase in (Phase.EXECUTE, Phase.WORKER, Phase.TRANSFER))
    print(table.drop(columns=["step"]).to_string(index=False))
    return result


if __name__ == "__main__":
    main()
