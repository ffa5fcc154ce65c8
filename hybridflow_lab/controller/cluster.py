"""Start or join the Ray cluster that worker groups run on."""

from __future__ import annotations

import os
from typing import Any

import ray

ADDRESS_ENV = "HYBRIDFLOW_RAY_ADDRESS"
NAMESPACE = "hybridflow_lab"


def default_cpu_slots() -> int:
    """Logical CPU slots for a local Ray, oversubscribed so that several pools fit on a small machine.

    A slot is a scheduling token, not a core: ranks share the cores and run one thread each.
    """
    return max(32, 16 * (os.cpu_count() or 1))


def init_cluster(address: str | None = None, num_cpus: int | None = None, **ray_init: Any) -> dict[str, float]:
    """Connect this controller to Ray and return the cluster's resources.

    With no ``address`` (and no ``HYBRIDFLOW_RAY_ADDRESS``) a local Ray starts with
    ``num_cpus`` logical CPU slots; with an address (``"auto"``, ``"ray://host:10001"``)
    the controller joins that cluster: the multi-node path. A second call is a no-op.
    """
    if not ray.is_initialized():
        address = address or os.environ.get(ADDRESS_ENV)
        options: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False, **ray_init}
        if address:
            ray.init(address=address, **options)
        else:
            ray.init(num_cpus=num_cpus or default_cpu_slots(), **options)
    return ray.cluster_resources()


def shutdown_cluster() -> None:
    """Stop every worker group of this controller and disconnect from Ray."""
    from hybridflow_lab.controller.worker_group import shutdown_all

    shutdown_all()
    if ray.is_initialized():
        ray.shutdown()


def alive_actors() -> list[str]:
    """Class names of the live Ray actors in the cluster (to check that nothing leaked)."""
    if not ray.is_initialized():
        return []
    from ray._private import state  # the public state API needs the dashboard, which we do not start

    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] == "ALIVE")
