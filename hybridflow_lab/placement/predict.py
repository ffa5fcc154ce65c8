"""The simulator's prediction for a given placement (no search): per-stage seconds of one iteration."""

from __future__ import annotations

from hybridflow_lab.placement.automap import ColocatedSet, MappingPlan, plan_of
from hybridflow_lab.placement.hardware import HardwareProfile
from hybridflow_lab.placement.plan import Placement
from hybridflow_lab.placement.simulator import MEMORY_RESERVE, model_cost, resident_bytes
from hybridflow_lab.placement.workload import Workload


def predict(placement: Placement, workload: Workload, hardware: HardwareProfile,
            concurrent: bool = True) -> MappingPlan:
    """``placement`` scored like a searched plan: each pool a colocated set (models of ``workload`` only), the
    actor's KV cache sized from what the pool's models leave free. ``concurrent``: the pools' stages run side by
    side (a Lab that overlaps its stages, ``suggest.overlaps``), else one after another."""
    placement.check_sizes()
    sets = []
    for pool, models in placement.used_pools().items():
        roles = tuple(m for m in models if m in workload.models)
        if not roles:
            continue
        layouts = {m: placement.size_of(m) for m in roles}
        resident = sum(resident_bytes(m, workload.models[m], layouts[m], workload) for m in roles)
        free = hardware.memory_bytes * MEMORY_RESERVE - resident
        costs = tuple(model_cost(m, workload.models[m], layouts[m], workload, hardware, free) for m in roles)
        sets.append(ColocatedSet(roles, placement.pools[pool], costs))
    return plan_of(tuple(sets), workload.stages, concurrent, hardware.step_overhead_s)
