"""The multi-node path: a Lab joins an existing two-node Ray cluster by address, and leaves it running.

Both nodes run on this machine at their own loopback addresses (127.0.0.2, 127.0.0.3): Ray rewrites
127.0.0.1 and ``localhost`` to the machine's outward address, but leaves the rest of 127.0.0.0/8 alone.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster

from hybridflow_lab.controller.cluster import ADDRESS_ENV
from hybridflow_lab.models import create_model_dir

ROOT = Path(__file__).resolve().parents[1]
HEAD, WORKER = "127.0.0.2", "127.0.0.3"

pytestmark = pytest.mark.ray


@pytest.fixture
def two_nodes():
    """A Ray cluster of two nodes with 2 CPU slots each, its own processes of this test's."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": HEAD,
                                                           "include_dashboard": False})
    cluster.add_node(num_cpus=2, node_ip_address=WORKER)
    yield cluster
    cluster.shutdown()


def run_driver(address: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ADDRESS_ENV: address}
    return subprocess.run([sys.executable, "-m", "tests.multinode_driver", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_lab_joins_a_two_node_cluster_spreads_its_ranks_steps_and_leaves_it_running(two_nodes, tmp_path):
    model_dir = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=11)
    done = run_driver(two_nodes.address, str(model_dir), str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cluster"] == two_nodes.address
    for role in ("actor", "critic"):  # PPO, the critic colocated with the actor: one rank of each on each node
        assert sorted(report["nodes"][role]) == [HEAD, WORKER]
    assert report["step"] == 2
    assert all(norm > 0 for norm in report["critic_grad_norms"])  # the DDP all-reduce ran across the nodes
    assert all(ipaddress.ip_address(address).is_loopback for address in report["connections"])
    assert {HEAD, WORKER} <= set(report["connections"])
    nodes = two_nodes.global_state.node_table()
    assert len(nodes) == 2 and all(node["Alive"] for node in nodes)  # the Lab's shutdown left the cluster up
    alive = [actor for actor in two_nodes.global_state.actor_table(None).values() if actor["State"] == "ALIVE"]
    assert alive == []  # and took its ranks with it


def test_a_pool_spread_over_more_nodes_than_the_cluster_has_fails_naming_the_key(two_nodes, tmp_path):
    model_dir = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=11)
    done = run_driver(two_nodes.address, str(model_dir), str(tmp_path / "run"), "actor.ranks=4", "critic.ranks=4",
                      "actor.nodes=4", "critic.nodes=4", "batch.micro_batch_sequences_per_rank=4")
    assert done.returncode != 0
    assert "spreads [1, 1, 1, 1] slots" in done.stderr and "the Ray cluster has 2 alive node(s)" in done.stderr
    assert "set the role's nodes to 1" in done.stderr


def test_a_local_ray_starts_even_where_an_old_cluster_left_its_address():
    """Ray's address file can name a cluster that was killed, not stopped; a local Ray must not try to join it."""
    script = ("import ray\n"
              "from ray._private.utils import write_ray_address\n"
              "from hybridflow_lab.controller import init_cluster\n"
              "write_ray_address('127.0.0.9:6379')\n"
              "print(init_cluster(num_cpus=2)['CPU'])\n"
              "ray.shutdown()\n")
    env = {key: value for key, value in os.environ.items() if key not in (ADDRESS_ENV, "RAY_ADDRESS")}
    with tempfile.TemporaryDirectory(dir="/tmp") as ray_tmp:  # short: Ray's socket paths must fit 107 bytes
        Path(ray_tmp, "ray").mkdir()
        done = subprocess.run([sys.executable, "-c", script], env={**env, "RAY_TMPDIR": ray_tmp}, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "2.0"
