"""Moving a running Lab to another config: which trained roles carry their state across, and what was done."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow_lab.config import LabConfig
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.dataflows import RunNeeds, check_config
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.trainer.capture import captured_stages
from hybridflow_lab.trainer.groups import RunGroups
from hybridflow_lab.trainer.task_setup import TaskSetup, build_task

if TYPE_CHECKING:
    from hybridflow_lab.placement import Placement


@dataclass(frozen=True)
class Reconfigured:
    """What ``Lab.reconfigure`` did: the new ``config``; whether running groups ``restarted``; the roles whose
    weights, optimizer state and schedule ``carried`` over (bytes each) and those that ``started_fresh`` from their
    model path (why); the ``checkpoint`` of the step saved before the restart; its ``seconds``."""

    overrides: tuple[str, ...]
    config: LabConfig
    step: int
    restarted: bool = False
    carried: dict[str, int] = field(default_factory=dict)
    started_fresh: dict[str, str] = field(default_factory=dict)
    checkpoint: str | None = None
    seconds: float = 0.0

    def __str__(self) -> str:
        if not self.restarted:
            return f"reconfigured ({', '.join(self.overrides)}); no worker group was running"
        parts = [f"restarted at step {self.step} in {self.seconds:.1f} s"]
        parts += [f"{role} carried over ({size / 2**20:.1f} MiB of weights and optimizer state)"
                  for role, size in self.carried.items()]
        parts += [f"{role} starts from its model path ({why})" for role, why in self.started_fresh.items()]
        return "; ".join(parts) + f"; step {self.step} is saved in {self.checkpoint}"


def carried_states(old: LabConfig, new: LabConfig, new_roles: tuple[str, ...],
                   states: dict[str, TrainingState]) -> tuple[dict[str, TrainingState], dict[str, str]]:
    """Which of ``states`` (the trained roles' under ``old``) the roles of ``new`` continue from, and why the
    others start from their model path: a role new to the run, another model, other LoRA settings. A role that
    leaves the run is named too (its state is only in the checkpoint)."""
    carried, fresh = {}, {}
    for role in new_roles:
        before, after = getattr(old, role), getattr(new, role)
        if role not in states:
            fresh[role] = "new in this run"
        elif (before.model_path or old.actor.model_path) != (after.model_path or new.actor.model_path):
            fresh[role] = "its model path changed"
        elif before.lora != after.lora:
            fresh[role] = "its LoRA settings changed, so its trained tensors did"
        else:
            carried[role] = states[role]
    fresh.update({role: "no longer in the run" for role in states if role not in new_roles})
    return carried, fresh


def checked_relayout(config: LabConfig, overrides: tuple[str, ...]) -> tuple[LabConfig, RunNeeds, list[str],
                                                                            TaskSetup]:
    """``config`` with ``overrides``, checked before anything changes: what the run needs, the stages it captures
    and its task (the task's own checks, dataset rows and prompt lengths, under the new settings)."""
    new = resolve_config(config, overrides)
    return new, check_config(new), captured_stages(new), build_task(new)


def restart_carrying(groups: RunGroups, old: LabConfig, new: LabConfig, roles: tuple[str, ...],
                     save: Callable[[], Path], start: Callable[[dict[str, TrainingState]], None], step: int,
                     overrides: tuple[str, ...], began: float) -> Reconfigured:
    """Restart ``groups`` (running under ``old``) under ``new`` with the trained ``roles``: their states gathered,
    the step checkpointed by ``save`` (so a layout that fails to start loses nothing), then ``start`` with the
    states that carry over; a role that cannot carry its state is named in a warning."""
    states = groups.training_states()
    checkpoint = save()
    carried, fresh = carried_states(old, new, roles, states)
    try:
        start(carried)
    except BaseException as error:
        error.add_note(f"step {step} is saved in {checkpoint}: Lab(<a config that starts>, resume=True) continues "
                       "from it")
        raise
    for role, why in fresh.items():
        if role in states:
            warnings.warn(f"lab.reconfigure: the {role}'s trained state was not carried over ({why}); it is in "
                          f"{checkpoint}", stacklevel=3)
    return Reconfigured(overrides, new, step, True, {role: state.nbytes for role, state in carried.items()}, fresh,
                        str(checkpoint), time.perf_counter() - began)


def place(config: LabConfig, placement: Placement) -> LabConfig:
    """``config`` run with ``placement``, checked (``Placement.apply``) and its pools fitted to this machine's
    memory."""
    from hybridflow_lab.placement.hardware import machine_profile
    from hybridflow_lab.placement.workload import workload_from_config

    placed = placement.apply(config)
    placement.check_memory(workload_from_config(placed), machine_profile(placement.devices_needed()))
    return placed
