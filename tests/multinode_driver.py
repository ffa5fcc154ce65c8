"""A notebook's part in ``test_multinode.py``, run in its own process: a Lab joins the Ray cluster that
``HYBRIDFLOW_RAY_ADDRESS`` names, spreads the actor's ranks over two nodes, steps, and reports as JSON."""

from __future__ import annotations

import ipaddress
import json
import sys

import psutil
import ray

from hybridflow_lab.trainer.lab import Lab


def remote_addresses(pids: list[int]) -> list[str]:
    """Every address the processes ``pids`` hold a connection to."""
    found = set()
    for pid in pids:
        for connection in psutil.Process(pid).net_connections(kind="inet"):
            if connection.raddr:
                found.add(str(ipaddress.ip_address(connection.raddr.ip.removeprefix("::ffff:"))))
    return sorted(found)


def main(model_dir: str, run_dir: str, *overrides: str) -> None:
    lab = Lab("arithmetic_grpo", overrides=(
        "backend=ray", "algorithm.name=ppo", f"actor.model_path={model_dir}", "actor.ranks=2", "actor.nodes=2",
        "critic.ranks=2", "critic.nodes=2", "actor.engine.backend=torch", "critic.engine.backend=torch",
        "actor.optim.lr=1e-3", "critic.optim.lr=1e-3", f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "algorithm.overlong_buffer=4", "batch.rollout_batch_prompts=4",
        "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=16", "batch.micro_batch_sequences_per_rank=8",
        "task.eval_size=8", "rollout.max_new_tokens=5", *overrides))
    steps = [lab.step() for _ in range(2)]
    pids = lab.actor.pids() + lab.critic.pids()
    report = {"cluster": ray.get_runtime_context().gcs_address, "pids": pids,
              "nodes": {role: group.node_addresses() for role, group in lab.groups.items()},
              "step": lab.step_index, "scores": [m["critic/score/mean"] for m in steps],
              "critic_grad_norms": [m["critic/grad_norm"] for m in steps],
              "actor_grad_norms": [m["actor/grad_norm"] for m in steps],
              "connections": remote_addresses([*pids, psutil.Process().pid])}
    lab.shutdown()
    ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
