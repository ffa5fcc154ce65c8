"""The paper's auto-mapping (section 6, Algorithms 1 and 2): which models share devices, how many devices each
set gets, and each model's parallel sizes, ranked by the simulator's iteration time.

Algorithm 1 enumerates the colocation sets (set partitions of the models: 15 for four), the fewest
devices each set needs to fit in memory, and every split of the devices among the sets. Algorithm 2
(``auto_parallel``) sweeps each model's (t, p, d), and the actor's generation ``tg``, on a set's
devices. Within a set the models take turns, so stage times add; sets run side by side, so each stage
takes the slowest set (the paper's ``d_cost``). Results are cached per (models, devices).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cache

from hybridflow_lab.hybrid.layout import ParallelLayout
from hybridflow_lab.placement.hardware import GIB, HardwareProfile
from hybridflow_lab.placement.simulator import MEMORY_RESERVE, ModelCost, model_cost, resident_bytes
from hybridflow_lab.placement.workload import Workload


@dataclass(frozen=True)
class ColocatedSet:
    """Models sharing ``devices`` devices, each with its parallel sizes and costs."""

    roles: tuple[str, ...]
    devices: int
    costs: tuple[ModelCost, ...]

    def stage_s(self, stage: str) -> float:
        return sum(cost.stage_s[stage] for cost in self.costs)

    @property
    def memory_bytes(self) -> float:
        return sum(cost.memory_bytes for cost in self.costs)

    def describe(self) -> str:
        parts = ", ".join(f"{c.role} {c.layout.label()}" for c in self.costs)
        return f"{'+'.join(self.roles)} on {self.devices} ({parts})"


@dataclass(frozen=True)
class MappingPlan:
    """A placement: the colocated sets, and per stage the slowest set's seconds."""

    sets: tuple[ColocatedSet, ...]
    stage_s: dict[str, float]
    controller_s: float = 0.0  # the controller's own work per iteration (rewards, advantages, data movement)
    concurrent: bool = True  # the sets run side by side (each stage waits for the slowest), or one after another

    @property
    def total_s(self) -> float:
        return sum(self.stage_s.values()) + self.controller_s

    @property
    def kind(self) -> str:
        """The paper's names: ``colocate`` (one set), ``split`` (actor and reference / the others),
        ``standalone`` (one model per set); any other grouping is ``mixed``."""
        groups = {frozenset(s.roles) for s in self.sets}
        if len(groups) == 1:
            return "colocate"
        if all(len(group) == 1 for group in groups):
            return "standalone"
        actor_side = frozenset(r for r in ("actor", "reference") if any(r in g for g in groups))
        return "split" if len(groups) == 2 and actor_side in groups else "mixed"

    def describe(self) -> str:
        return " | ".join(s.describe() for s in self.sets)

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "total_s": round(self.total_s, 4), "controller_s": round(self.controller_s, 4),
                "stage_s": {k: round(v, 4) for k, v in self.stage_s.items()},
                "sets": [{"roles": list(s.roles), "devices": s.devices,
                          "models": {c.role: {"t": c.layout.t, "p": c.layout.p, "d": c.layout.d,
                                              "tg": c.layout.tg, "memory_gib": round(c.memory_bytes / GIB, 3),
                                              "stage_s": {k: round(v, 4) for k, v in c.stage_s.items()}}
                                     for c in s.costs}} for s in self.sets]}


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split ``items`` into non-empty unordered groups (Bell(n) of them), groups in item order."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [(first,), *partition]
        for index in range(len(partition)):
            yield [*partition[:index], (first, *partition[index]), *partition[index + 1:]]


def compositions(total: int, parts: int, minimums: Sequence[int], unit: int) -> Iterator[tuple[int, ...]]:
    """Splits of ``total`` devices into ``parts`` multiples of ``unit``, each at least its minimum."""
    if parts == 1:
        if total >= minimums[0]:
            yield (total,)
        return
    for first in range(minimums[0], total - sum(minimums[1:]) + 1, unit):
        for rest in compositions(total - first, parts - 1, minimums[1:], unit):
            yield (first, *rest)


class AutoMapper:
    """Ranks placements of ``workload`` on ``devices`` devices of ``hardware``.

    ``together`` keeps roles in one set (the Lab runs the reference and reward model inside the actor's
    ranks); ``follow_actor`` roles take the actor's parallel sizes (the Lab's reference is sharded like
    the actor); ``max_pipeline``, ``tensor_parallel_roles`` and ``pipeline_parallel_roles`` restrict the
    sweep to what the runtime supports; ``concurrent_sets=False`` scores a runtime that runs the sets'
    stages one after another; ``allow_idle`` also tries leaving devices unused (CPU ranks that share
    cores can be faster fewer); ``runs(role, layout)`` keeps only the layouts the runtime accepts.
    """

    def __init__(self, workload: Workload, hardware: HardwareProfile, devices: int, *,
                 together: Sequence[str] = (), max_pipeline: int = 16,
                 tensor_parallel_roles: Sequence[str] | None = None,
                 pipeline_parallel_roles: Sequence[str] | None = None, concurrent_sets: bool = True,
                 follow_actor: Sequence[str] = (), allow_idle: bool = False,
                 runs: Callable[[str, ParallelLayout], bool] | None = None) -> None:
        self.workload, self.hardware, self.devices = workload, hardware, devices
        self.allow_idle, self.runs = allow_idle, runs
        self.follow_actor = tuple(r for r in follow_actor if r in workload.models)
        self.concurrent_sets = concurrent_sets
        self.together = tuple(r for r in together if r in workload.models)
        self.max_pipeline = max_pipeline
        self.tensor_parallel_roles = workload.roles if tensor_parallel_roles is None else tuple(tensor_parallel_roles)
        self.pipeline_parallel_roles = workload.roles if pipeline_parallel_roles is None \
            else tuple(pipeline_parallel_roles)
        per_node = hardware.devices_per_node
        self.unit = per_node if devices % per_node == 0 and devices >= 2 * per_node else 1
        self.capacity = hardware.memory_bytes * MEMORY_RESERVE
        self.best_for_set = cache(self._best_for_set)

    # ------------------------------------------------------------------ Algorithm 2
    def parallel_choices(self, role: str, devices: int) -> list[ParallelLayout]:
        """(t, p, d) with t*p*d = ``devices``: t a power of two splitting the heads, within a node; p splitting
        the layers; the actor also sweeps its generation ``tg`` (dividing t)."""
        spec = self.workload.models[role]
        max_t = min(self.hardware.devices_per_node, devices) if role in self.tensor_parallel_roles else 1
        max_p = min(self.max_pipeline, spec.layers) if role in self.pipeline_parallel_roles else 1
        sizes = [t for t in (1, 2, 4, 8, 16, 32) if t <= max_t and spec.heads % t == 0 and spec.kv_heads % t == 0]
        choices = []
        for t in sizes:
            for p in range(1, max_p + 1):
                if spec.layers % p or devices % (t * p):
                    continue
                tgs = [g for g in sizes if t % g == 0] if role == "actor" else [t]
                choices += [ParallelLayout(t=t, p=p, d=devices // (t * p), tg=tg) for tg in tgs]
        return [layout for layout in choices if self.runs is None or self.runs(role, layout)]

    def _best_for_set(self, roles: tuple[str, ...], devices: int) -> ColocatedSet | None:
        """The fastest parallel sizes for ``roles`` sharing ``devices`` that fit in memory together, or None.

        Only the actor's cost depends on the memory left (its KV cache); for the other models only the
        settings that no other setting beats on both memory and time are combined.
        """
        workload, hardware, best = self.workload, self.hardware, None
        followers = [r for r in roles if r in self.follow_actor and "actor" in roles]
        fixed = {role: _pareto([model_cost(role, workload.models[role], par, workload, hardware, 0.0)
                                for par in self.parallel_choices(role, devices)])
                 for role in roles if role != "actor" and role not in followers}
        actor = [(par, resident_bytes("actor", workload.models["actor"], par, workload))
                 for par in self.parallel_choices("actor", devices)] if "actor" in roles else [(None, 0.0)]
        for (actor_par, actor_memory), others in itertools.product(actor, itertools.product(*fixed.values())):
            costs = list(others)
            if actor_par is not None:
                like_actor = replace(actor_par, tg=actor_par.t)
                costs += [model_cost(r, workload.models[r], like_actor, workload, hardware, 0.0) for r in followers]
            resident = actor_memory + sum(cost.memory_bytes for cost in costs)
            if resident > self.capacity:
                continue
            if actor_par is not None:
                costs.append(model_cost("actor", workload.models["actor"], actor_par, workload, hardware,
                                        self.capacity - resident))
            candidate = ColocatedSet(roles, devices, tuple(sorted(costs, key=lambda c: roles.index(c.role))))
            if best is None or _set_total(candidate) < _set_total(best):
                best = candidate
        return best if best is not None and _set_total(best) < float("inf") else None

    # ------------------------------------------------------------------ Algorithm 1
    def minimal_devices(self, roles: tuple[str, ...]) -> int | None:
        """The fewest devices (in allocation units) on which ``roles`` fit together."""
        for devices in range(self.unit, self.devices + 1, self.unit):
            if self.best_for_set(roles, devices) is not None:
                return devices
        return None

    def placements(self) -> Iterator[list[tuple[str, ...]]]:
        """The colocation sets to consider: every partition of the models that keeps ``together`` in one set."""
        for partition in set_partitions(list(self.workload.roles)):
            if not self.together or any(set(self.together) <= set(group) for group in partition):
                yield partition

    def search(self, top: int = 10) -> list[MappingPlan]:
        """The ``top`` placements by predicted iteration time, fastest first."""
        plans = []
        for partition in self.placements():
            minimums = [self.minimal_devices(group) for group in partition]
            fitting = [m for m in minimums if m is not None]
            if len(fitting) == len(partition) and sum(fitting) <= self.devices:
                best = self._best_allocation(partition, fitting)
                plans += [best] if best is not None else []
        return sorted(plans, key=lambda plan: plan.total_s)[:top]

    def _best_allocation(self, partition: list[tuple[str, ...]], minimums: list[int]) -> MappingPlan | None:
        """The fastest split of the devices (all of them, or fewer with ``allow_idle``) among the sets."""
        totals = range(sum(minimums), self.devices + 1, self.unit) if self.allow_idle else [self.devices]
        best = None
        for total in totals:
            for allocation in compositions(total, len(partition), minimums, self.unit):
                sets = [self.best_for_set(group, n) for group, n in zip(partition, allocation, strict=True)]
                if any(s is None for s in sets):
                    continue
                plan = plan_of(tuple(s for s in sets if s is not None), self.workload.stages, self.concurrent_sets,
                               self.hardware.step_overhead_s)
                if best is None or plan.total_s < best.total_s:
                    best = plan
        return best


def plan_of(sets: tuple[ColocatedSet, ...], stages: Sequence[str], concurrent: bool = True,
            controller_s: float = 0.0) -> MappingPlan:
    """``d_cost``: stage times add within a set; each stage waits for the slowest set when sets run side by side
    (``concurrent``, the paper's execution), or for all of them when the controller calls them one by one."""
    combine = max if concurrent else sum
    return MappingPlan(sets, {stage: combine(s.stage_s(stage) for s in sets) for stage in stages}, controller_s,
                       concurrent)


def _pareto(costs: list[ModelCost]) -> list[ModelCost]:
    """The costs that no other beats on both memory and time, by increasing memory."""
    front: list[ModelCost] = []
    for cost in sorted(costs, key=lambda c: (c.memory_bytes, c.total_s)):
        if not front or cost.total_s < front[-1].total_s:
            front.append(cost)
    return front


def _set_total(colocated: ColocatedSet) -> float:
    return sum(colocated.stage_s(stage) for stage in colocated.costs[0].stage_s)
