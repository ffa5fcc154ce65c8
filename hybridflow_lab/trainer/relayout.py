"""Moving a running Lab to another config: which trained roles carry their state across, and what was done."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow_lab.config import LabConfig
from hybridflow_lab.engines import TrainingState


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
