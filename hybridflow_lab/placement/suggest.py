"""Ranked suggestions for a Lab: the auto-mapping search restricted to what the Lab runs, as placement plans.

The Lab keeps the reference and reward models inside the actor's ranks and trains only the actor
tensor-parallel or in pipeline stages (with the torch engine; the reference follows the actor's sizes),
so the search runs with those limits; it may leave device slots unused (CPU ranks share cores). It sweeps
only the actor's stage counts that the config validation accepts (``runs_in_lab``: not for a model with
tied embeddings, nor a 1F1B schedule with fewer micro-batches than stages), and leaves out a searched plan
that the validation still refuses. Models on different pools run side by side when the Lab overlaps its
stages (``trainer.overlap`` on Ray), one after another otherwise.
"""

from __future__ import annotations

from functools import partial

from hybridflow_lab.config import LabConfig
from hybridflow_lab.hybrid.layout import ParallelLayout
from hybridflow_lab.placement.automap import AutoMapper, MappingPlan
from hybridflow_lab.placement.hardware import HardwareProfile, get_profile
from hybridflow_lab.placement.plan import Placement, Suggestion
from hybridflow_lab.placement.workload import workload_from_config

# the actor's pipeline stages are bounded by its layers (the search's own limit) and by the config validation
# (``runs_in_lab``)
LAB_LIMITS = {"together": ("actor", "reference", "reward"), "tensor_parallel_roles": ("actor",),
              "pipeline_parallel_roles": ("actor",), "follow_actor": ("reference",), "allow_idle": True}


def overlaps(config: LabConfig) -> bool:
    """Whether ``config``'s Lab runs the stages of different pools at the same time."""
    return config.trainer.overlap and config.backend == "ray"


def runs_in_lab(config: LabConfig, role: str, layout: ParallelLayout) -> bool:
    """Whether the Lab runs ``role`` on ``layout`` as far as the layout decides: the actor's pipeline stages pass
    the config validation on a pool of their own (the model splits into them; the 1F1B schedule gets a micro-batch
    per stage). Other layouts are left to ``Placement.problem``, which checks the whole plan."""
    if role != "actor" or layout.p == 1:
        return True
    alone = Placement({"actor": layout.world_size}, {"actor": "actor"}, {"actor": layout})
    return alone.problem(config, layout.world_size) is None


def lab_mapper(config: LabConfig, devices: int, hardware: HardwareProfile | str = "cpu") -> AutoMapper:
    """The search over placements the Lab can run for ``config`` on ``devices`` device slots."""
    profile = get_profile(hardware) if isinstance(hardware, str) else hardware
    return AutoMapper(workload_from_config(config), profile, devices, concurrent_sets=overlaps(config),
                      runs=partial(runs_in_lab, config), **LAB_LIMITS)  # type: ignore[arg-type]


def as_placement(plan: MappingPlan, config: LabConfig) -> Placement:
    """A searched plan as a placement of ``config``'s models: one pool per colocated set, the searched sizes, and
    the torch engine for a tensor-parallel or pipeline-parallel actor."""
    current = Placement.from_config(config)
    pools, assignment, sizes = {}, {}, {}
    for colocated in plan.sets:
        pool = "main" if "actor" in colocated.roles else colocated.roles[0]
        pools[pool] = colocated.devices
        for cost in colocated.costs:
            assignment[cost.role] = pool
            sizes[cost.role] = cost.layout
    engines = dict(current.engines)
    if sizes["actor"].t > 1 or sizes["actor"].p > 1:
        engines["actor"] = "torch"  # tensor- and pipeline-parallel training run on the torch engine
    return Placement(pools, assignment, sizes, engines, dict(current.zero_stages))


def suggest(config: LabConfig, devices: int, hardware: HardwareProfile | str = "cpu",
            top: int = 5) -> list[Suggestion]:
    """The ``top`` placements by predicted step time that also pass the Lab's config validation."""
    suggestions = []
    for plan in lab_mapper(config, devices, hardware).search(top=4 * top):
        placed = as_placement(plan, config)
        if placed.problem(config, devices) is None:
            actor = placed.size_of("actor")
            stages = f" p{actor.p}" if actor.p > 1 else ""
            label = f"{plan.kind}: {placed.pool_summary()}, actor t{actor.t}{stages} tg{actor.tg}"
            suggestions.append(Suggestion(label, placed, plan.total_s))
    return suggestions[:top]
