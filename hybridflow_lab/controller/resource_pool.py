"""``ResourcePool``: a set of device slots that worker groups are placed on."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

_pool_ids = itertools.count()
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node


class ResourcePool:
    """Device slots on one or more nodes: GPUs, or logical CPU slots on a CPU machine.

    ``ResourcePool(4)`` is 4 slots on one node; ``ResourcePool([8, 8])`` is 8 on each of two
    nodes. Groups built on the same pool share its slots (colocation: rank i of every group
    lands in slot i); groups on different pools run on disjoint devices (split placement).
    Placement groups are reserved in Ray when the first ray-backed group needs them, and given back when the
    last group placed on the pool shuts down (on a GPU machine a slot is a whole GPU).
    """

    def __init__(
        self,
        slots: int | Sequence[int] = 1,
        *,
        use_gpu: bool | None = None,
        cpus_per_slot: float = 1.0,
        max_colocate: int = 8,
        name: str | None = None,
    ) -> None:
        self.nodes = [slots] if isinstance(slots, int) else list(slots)
        if not self.nodes or any(not isinstance(n, int) or n < 1 for n in self.nodes):
            raise ValueError(f"ResourcePool slots must be positive whole numbers per node, got {slots!r}")
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.max_colocate = max_colocate
        self.name = name or f"pool{next(_pool_ids)}"
        self._placement_groups: list[PlacementGroup] = []
        self._finalizer: weakref.finalize | None = None
        self._groups = 0

    @property
    def world_size(self) -> int:
        return sum(self.nodes)

    def rank_slots(self) -> list[tuple[int, int]]:
        """``(node index, local rank)`` of every global rank, node by node."""
        return [(node, local) for node, count in enumerate(self.nodes) for local in range(count)]

    def resolve_gpu(self) -> bool:
        """Whether slots are GPUs: as configured, else whenever the Ray cluster has GPUs."""
        if self.use_gpu is None:
            self.use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        return self.use_gpu

    def placement_groups(self, timeout_s: float = 60.0) -> list[PlacementGroup]:
        """One placement group per node (reserved on first use), each with one bundle per slot."""
        if self._placement_groups:
            return self._placement_groups
        bundle: dict[str, float] = {"CPU": self.cpus_per_slot}
        if self.resolve_gpu():
            bundle["GPU"] = 1
        self._check_fits(bundle)
        targets = self._distinct_nodes(bundle) if len(self.nodes) > 1 else [None]
        groups = [placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{self.name}-{i}",
                                  bundle_label_selector=[{NODE_ID_LABEL: target}] * n if target else None)
                  for i, (n, target) in enumerate(zip(self.nodes, targets, strict=True))]
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for pg in groups:
                remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name!r}: Ray could not reserve {self.nodes} slots of {bundle} within "
                f"{timeout_s:.0f}s ({_free(bundle)}); shut down other pools' groups, use fewer slots, "
                "or start Ray with more (init_cluster(num_cpus=...))"
            )
        self._placement_groups = groups
        self._finalizer = weakref.finalize(self, _remove_groups, list(groups))
        return groups

    def _distinct_nodes(self, bundle: dict[str, float]) -> list[str]:
        """A different alive Ray node for each of the pool's nodes (in address order), each big enough for its
        slots: a pool spread over nodes must not be packed onto one."""
        alive = sorted((node for node in ray.nodes() if node["Alive"]),
                       key=lambda node: (node["NodeManagerAddress"], node["NodeID"]))
        chosen: list[str] = []
        for slots in self.nodes:
            fits = [node["NodeID"] for node in alive if node["NodeID"] not in chosen
                    and all(node["Resources"].get(r, 0) >= amount * slots for r, amount in bundle.items())]
            if not fits:
                sizes = ", ".join(f"{node['NodeManagerAddress']}: {node['Resources'].get('CPU', 0):g} CPU"
                                  for node in alive)
                raise RuntimeError(
                    f"resource pool {self.name!r} spreads {self.nodes} slots of {bundle} over {len(self.nodes)} nodes "
                    f"but the Ray cluster has {len(alive)} alive node(s) ({sizes}) and no other one fits {slots} "
                    "slots; join a cluster with more nodes, or set the role's nodes to 1"
                )
            chosen.append(fits[0])
        return chosen

    def _check_fits(self, bundle: dict[str, float]) -> None:
        """Fail at once when the whole cluster is too small (waiting could never help)."""
        total = ray.cluster_resources()
        for resource, amount in bundle.items():
            needed = amount * self.world_size
            if total.get(resource, 0) < needed:
                raise RuntimeError(
                    f"resource pool {self.name!r} needs {needed:g} {resource} ({self.world_size} slots x {amount:g}) "
                    f"but the whole Ray cluster has {total.get(resource, 0):g}; use fewer slots, or start Ray "
                    "with more (init_cluster(num_cpus=...)) or join a bigger cluster"
                )

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options that put ``rank`` in its slot, sharing it with colocated groups."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node, local = self.rank_slots()[rank]
        options: dict[str, Any] = {
            "num_cpus": self.cpus_per_slot / self.max_colocate,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_groups()[node], placement_group_bundle_index=local
            ),
        }
        if self.resolve_gpu():
            options["num_gpus"] = 1 / self.max_colocate
        return options

    def attach(self) -> None:
        """A group now runs on these slots: they stay reserved until it detaches."""
        self._groups += 1

    def detach(self) -> None:
        """A group placed here stopped; the slots go back to Ray once no group runs on them."""
        self._groups -= 1
        if self._groups == 0:
            self.release()

    def release(self) -> None:
        """Give the slots back to Ray; Ray stops any rank still placed on them."""
        if self._finalizer is not None:
            self._finalizer()
        self._placement_groups = []

    def __repr__(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU" if self.use_gpu is False else "auto"
        return f"ResourcePool({self.name!r}, slots per node={self.nodes}, {kind})"


def _free(bundle: dict[str, float]) -> str:
    free, total = ray.available_resources(), ray.cluster_resources()
    return ", ".join(f"{free.get(r, 0):g} of {total.get(r, 0):g} {r} free" for r in bundle)


def _remove_groups(groups: list[PlacementGroup]) -> None:
    if ray.is_initialized():
        for pg in groups:
            remove_placement_group(pg)
