"""A run's worker groups: built for a config on resource pools of their own, checkpointed and shut down together."""

from __future__ import annotations

from pathlib import Path

from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup, init_cluster
from hybridflow_lab.dataflows import RunNeeds
from hybridflow_lab.engines import TrainingState
from hybridflow_lab.telemetry import TelemetryStore
from hybridflow_lab.workers import ActorWorker, CriticWorker, RewardModelWorker
from hybridflow_lab.workers.rollout import RolloutWorker


class RunGroups:
    """The groups by role (``actor``, ``critic``, ``rollout``, ``reward_model``: those the run needs) and the pools
    they hold. Trained roles (the actor, the critic) are the ones checkpointed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.by_role: dict[str, WorkerGroup] = {}
        self.trained_roles: tuple[str, ...] = ()
        self._pools: list[ResourcePool] = []

    def start(self, config: LabConfig, needs: RunNeeds, device: str, telemetry: TelemetryStore,
              carried: dict[str, TrainingState], ray_log: Path) -> None:
        """Build the groups ``needs`` asks for: one resource pool per pool name (a GPU per slot on ``cuda``); the
        trained roles continue from ``carried`` states where given. Ray starts here if it is not running, its
        start-up lines in ``ray_log`` (kept out of notebook cells)."""
        if config.backend == "ray":
            init_cluster(log_file=ray_log)
        self.trained_roles = needs.trained_roles
        pools = {pool: ResourcePool(slots, use_gpu=device == "cuda", name=f"{self.name}.{pool}")
                 for pool, slots in config.pool_nodes(needs.pooled_roles).items()}
        self._pools = list(pools.values())
        options = {"backend": config.backend, "telemetry": telemetry, "device": device,
                   "call_timeout_s": config.trainer.stage_timeout_s}
        actor_pool = pools[config.actor.pool]
        self.by_role["actor"] = WorkerGroup(Role(ActorWorker, config, needs.reference_model, carried.get("actor")),
                                            actor_pool, name=f"{self.name}.actor", meshes=ActorWorker.meshes(config),
                                            **options)
        if needs.critic:
            self.by_role["critic"] = WorkerGroup(Role(CriticWorker, config, carried.get("critic")),
                                                 pools[config.critic.pool], name=f"{self.name}.critic", **options)
        if needs.rollout_group:
            self.by_role["rollout"] = WorkerGroup(Role(RolloutWorker, config), pools[config.rollout.pool],
                                                  name=f"{self.name}.rollout", **options)
        if needs.reward_model:
            self.by_role["reward_model"] = WorkerGroup(
                Role(RewardModelWorker, config.reward_model_path, config.batch.micro_batch_sequences_per_rank),
                actor_pool, name=f"{self.name}.reward_model", **options)

    def shutdown(self) -> None:
        for group in self.by_role.values():
            group.shutdown()
        self.by_role = {}
        for pool in self._pools:
            pool.release()
        self._pools = []

    def get(self, role: str, why_missing: str) -> WorkerGroup:
        """The group of ``role``; a ``RuntimeError`` saying ``why_missing`` when the run has none."""
        if role not in self.by_role:
            raise RuntimeError(why_missing)
        return self.by_role[role]

    def trained(self) -> dict[str, WorkerGroup]:
        """The groups whose weights train and are checkpointed (not the frozen reward model, nor a rollout group,
        which copies the actor's)."""
        return {role: group for role, group in self.by_role.items() if role in self.trained_roles}

    def training_states(self) -> dict[str, TrainingState]:
        """Each trained role's weights, optimizer state and schedule, gathered to the controller."""
        return {role: group.training_state()[0] for role, group in self.trained().items()}

    def save(self, directory: Path) -> None:
        for role, group in self.trained().items():
            group.save_checkpoint(str(directory / role))

    def load(self, directory: Path) -> None:
        for role, group in self.trained().items():
            group.load_checkpoint(str(directory / role))
