"""A placement plan: pools of device slots, the pool each trained model runs on, and parallel sizes.

The plan is a view of a ``LabConfig`` that widgets (and the auto-mapping search) edit: it turns
back into dotted overrides, and ``problem`` says why a combination cannot work (the config
validation's message, or too few devices). The reference policy and a reward model run inside
the actor's ranks, so they follow the actor's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.trainer.lab import check_config, trained_roles
from hybridflow_lab.trainer.presets import resolve_config


@dataclass(frozen=True)
class Suggestion:
    """A ranked placement proposal (filled by the auto-mapping search): a label, the plan, its estimated cost."""

    label: str
    plan: PlacementPlan
    estimated_step_s: float


@dataclass(frozen=True)
class PlacementPlan:
    """``pools`` maps a pool name to its slot count; ``assignment`` maps each trained role to a pool."""

    pools: dict[str, int]
    assignment: dict[str, str]
    actor_tensor_parallel: int = 1  # training TP (the paper's t)
    rollout_tensor_parallel: int = 1  # generation TP (tg)
    engines: dict[str, str] = field(default_factory=dict)  # role -> train backend (torch | deepspeed | fsdp)
    zero_stages: dict[str, int] = field(default_factory=dict)  # role -> ZeRO stage (deepspeed only)

    @classmethod
    def from_config(cls, config: LabConfig) -> PlacementPlan:
        roles = trained_roles(config)
        return cls(pools=config.pool_slots(roles), assignment={role: getattr(config, role).pool for role in roles},
                   actor_tensor_parallel=config.actor.engine.tensor_parallel,
                   rollout_tensor_parallel=config.rollout.tensor_parallel,
                   engines={role: getattr(config, role).engine.backend for role in roles},
                   zero_stages={role: getattr(config, role).engine.zero_stage for role in roles})

    def overrides(self) -> list[str]:
        """The dotted overrides that turn a config into this plan."""
        items = [f"actor.engine.tensor_parallel={self.actor_tensor_parallel}",
                 f"rollout.tensor_parallel={self.rollout_tensor_parallel}"]
        for role, pool in self.assignment.items():
            items += [f"{role}.pool={pool}", f"{role}.ranks={self.pools[pool]}"]
            if role in self.engines:
                items.append(f"{role}.engine.backend={self.engines[role]}")
            if role in self.zero_stages:
                items.append(f"{role}.engine.zero_stage={self.zero_stages[role]}")
        return items

    def used_pools(self) -> dict[str, list[str]]:
        """Each pool that has roles, with its roles in assignment order."""
        used: dict[str, list[str]] = {}
        for role, pool in self.assignment.items():
            used.setdefault(pool, []).append(role)
        return used

    def devices_needed(self) -> int:
        return sum(self.pools[pool] for pool in self.used_pools())

    def device_map(self) -> list[tuple[str, list[str]]]:
        """Pools laid out on consecutive device slots: ``(pool, roles)`` for slot 0, 1, ..."""
        return [(pool, roles) for pool, roles in self.used_pools().items() for _ in range(self.pools[pool])]

    def with_changes(self, **changes: object) -> PlacementPlan:
        return replace(self, **changes)

    def apply(self, config: LabConfig) -> LabConfig:
        """``config`` with this placement; raises ``ConfigError`` when it cannot work."""
        placed = resolve_config(config, self.overrides())
        check_config(placed)
        return placed

    def problem(self, config: LabConfig, devices: int) -> str | None:
        """Why this plan cannot run on ``devices`` slots with ``config``, or None when it can."""
        if self.devices_needed() > devices:
            return (f"the pools need {self.devices_needed()} device slots ({self.pool_summary()}) but there are "
                    f"{devices}; shrink a pool or colocate roles on one pool")
        try:
            self.apply(config)
        except ConfigError as error:
            return str(error)
        return None

    def pool_summary(self) -> str:
        return ", ".join(f"{pool}: {self.pools[pool]}" for pool in self.used_pools())

    def pool_size_choices(self, config: LabConfig, devices: int, pool: str) -> list[int]:
        """The slot counts of ``pool`` that make a valid plan, the other settings unchanged."""
        return [size for size in range(1, devices + 1)
                if self.with_changes(pools={**self.pools, pool: size}).problem(config, devices) is None]

    def tensor_parallel_choices(self, config: LabConfig, devices: int, which: str = "rollout") -> list[int]:
        """The generation (``which="rollout"``) or training (``"actor"``) tensor-parallel sizes that make a valid
        plan."""
        actor_slots = self.pools[self.assignment["actor"]]
        return [tp for tp in range(1, actor_slots + 1)
                if self.with_changes(**{f"{which}_tensor_parallel": tp}).problem(config, devices) is None]
