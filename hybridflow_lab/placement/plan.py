"""A placement: device pools, the pool each model runs on, and each model's parallel sizes.

``Placement`` is what the placement board edits, what the auto-mapping search proposes and what
``Lab(config, placement=...)`` runs. It checks itself before any worker starts: sizes divide the
pools, the models on a pool fit in a device's memory (``check_memory``), and, for a Lab, what the
Lab can run (``apply``: the reference and reward models inside the actor's ranks, tensor-parallel and
pipeline-parallel training for the actor only, generation on one pipeline stage). It prints as a table
and round-trips through YAML.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hybridflow_lab.config import ConfigError, LabConfig
from hybridflow_lab.config.batch_sizes import divisors
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.dataflows import RunNeeds, check_config
from hybridflow_lab.hybrid.layout import ParallelLayout
from hybridflow_lab.placement.hardware import GIB, HardwareProfile
from hybridflow_lab.placement.report import text_table
from hybridflow_lab.placement.simulator import MEMORY_RESERVE, resident_bytes
from hybridflow_lab.placement.workload import ROLES, Workload

INSIDE_ACTOR = ("reference", "reward", "cost")  # the Lab runs these in the actor's processes
SIZES = ("t", "p", "tg", "pg")  # a model's sizes in a placement; d fills its pool


def _sized(model: str, layout: ParallelLayout, sizes: Mapping[str, int]) -> ParallelLayout:
    """``layout`` with ``sizes`` changed; a size that is unknown or impossible raises ``ConfigError`` naming
    ``placement.<model>``."""
    if unknown := sorted(set(sizes) - set(SIZES)):
        raise ConfigError(f"placement.{model}", f"unknown sizes {unknown}; a model's sizes are {list(SIZES)} (data "
                          "parallel d fills the pool)")
    try:
        return replace(layout, **sizes)
    except ValueError as error:
        raise ConfigError(f"placement.{model}", str(error)) from None


@dataclass(frozen=True)
class Suggestion:
    """A ranked placement proposal (from the auto-mapping search): a label, the placement, its estimated cost."""

    label: str
    plan: Placement
    estimated_step_s: float


@dataclass(frozen=True)
class Placement:
    """``pools``: device count per pool name; ``assignment``: model -> pool; ``sizes``: model -> layout, whose
    data parallel ``d`` is set to fill the model's pool.

    ``engines`` and ``zero_stages`` hold the trained models' training backends; ``devices_per_node``
    (0: one node) says where a pool's devices sit.
    """

    pools: dict[str, int]
    assignment: dict[str, str]
    sizes: dict[str, ParallelLayout] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    zero_stages: dict[str, int] = field(default_factory=dict)
    devices_per_node: int = 0

    def __post_init__(self) -> None:
        # d is not chosen but follows the pool, so a layout stays whole when pools or sizes change
        object.__setattr__(self, "sizes", {model: self._filled(model, layout) for model, layout in self.sizes.items()})

    def _filled(self, model: str, layout: ParallelLayout) -> ParallelLayout:
        devices = self.pools.get(self.assignment.get(model, ""), 0)
        return replace(layout, d=max(1, devices // (layout.t * layout.p)))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config: LabConfig) -> Placement:
        """The placement a config describes: trained roles on their pools, the models the run builds inside the
        actor's ranks (a reference copy, a reward model) on the actor's."""
        needs = RunNeeds.of(config)
        roles = needs.trained_roles
        assignment = {role: getattr(config, role).pool for role in roles}
        inside = (["reference"] if needs.reference_model else []) + (["reward"] if needs.reward_model else [])
        assignment.update(dict.fromkeys(inside, config.actor.pool))
        t, tg = config.actor.engine.tensor_parallel, config.rollout.tensor_parallel
        if t % tg:  # vLLM may shard generation over more ranks than a training shard group
            raise ConfigError("rollout.tensor_parallel", f"generation TP {tg} does not divide the actor's training TP "
                              f"{t}, so the run has no placement (its generation shards are not whole training "
                              f"shards); a placement needs rollout.tensor_parallel in {divisors(t)}")
        p = config.actor.engine.pipeline_parallel
        actor = ParallelLayout(t=t, p=p, tg=tg)
        sizes = {"actor": actor, **({"reference": ParallelLayout(t=t, p=p, tg=t)} if "reference" in inside else {})}
        return cls(pools=config.pool_slots(roles), assignment=assignment, sizes=sizes,
                   engines={role: getattr(config, role).engine.backend for role in roles},
                   zero_stages={role: getattr(config, role).engine.zero_stage for role in roles})

    @classmethod
    def colocate_all(cls, models: tuple[str, ...], devices: int) -> Placement:
        """The paper's "colocate": every model on one pool of ``devices``."""
        return cls({"main": devices}, dict.fromkeys(models, "main"))

    @classmethod
    def split(cls, models: tuple[str, ...], actor_devices: int, critic_devices: int) -> Placement:
        """The paper's "split": actor and reference on one pool, critic and reward (and cost) on another."""
        return cls({"main": actor_devices, "critic": critic_devices},
                   {m: "main" if m in ("actor", "reference") else "critic" for m in models})

    @classmethod
    def standalone(cls, devices: dict[str, int]) -> Placement:
        """The paper's "standalone": each model on its own pool of ``devices[model]``."""
        return cls(dict(devices), {model: model for model in devices})

    def with_changes(self, **changes: Any) -> Placement:
        return replace(self, **changes)

    def moved(self, model: str, pool: str) -> Placement:
        """``model`` on ``pool`` (a new pool starts with the model's current device count); moving the actor
        takes the models the Lab runs inside its ranks along."""
        size = self.pools.get(pool, self.pools[self.assignment[model]])
        followers = [m for m in INSIDE_ACTOR if m in self.assignment] if model == "actor" else []
        return replace(self, pools={**self.pools, pool: size},
                       assignment={**self.assignment, **dict.fromkeys([model, *followers], pool)})

    def with_sizes(self, model: str, **sizes: int) -> Placement:
        """This placement with some of ``model``'s sizes (``t``, ``p``, ``tg``, ``pg``) changed."""
        return replace(self, sizes={**self.sizes, model: _sized(model, self.size_of(model), sizes)})

    # ------------------------------------------------------------------ reading
    def size_of(self, model: str) -> ParallelLayout:
        """``model``'s layout, data parallel filling its pool (``check_sizes`` checks that it does evenly)."""
        return self.sizes.get(model) or self._filled(model, ParallelLayout())

    def used_pools(self) -> dict[str, list[str]]:
        """Each pool that has models, with its models in assignment order."""
        used: dict[str, list[str]] = {}
        for model, pool in self.assignment.items():
            used.setdefault(pool, []).append(model)
        return used

    def devices_needed(self) -> int:
        return sum(self.pools[pool] for pool in self.used_pools())

    def device_map(self) -> list[tuple[str, list[str]]]:
        """Pools laid out on consecutive device slots: ``(pool, models)`` for slot 0, 1, ..."""
        return [(pool, models) for pool, models in self.used_pools().items() for _ in range(self.pools[pool])]

    def pool_summary(self) -> str:
        return ", ".join(f"{pool}: {self.pools[pool]}" for pool in self.used_pools())

    def table(self) -> str:
        """One line per model: its pool, devices and parallel sizes."""
        header = ("model", "pool", "devices", "t", "p", "d", "tg", "pg", "engine")
        return text_table([header] + [
            (model, pool, str(self.pools[pool]), *map(str, (par.t, par.p, par.d, par.tg, par.pg)),
             self.engines.get(model, "-"))
            for model, pool in self.assignment.items() for par in [self.size_of(model)]])

    def _repr_html_(self) -> str:
        lines = self.table().splitlines()
        cells = [line.split() for line in lines]
        head = "".join(f"<th>{c}</th>" for c in cells[0])
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in cells[1:])
        return f"<table class='hybridflow-placement'><tr>{head}</tr>{body}</table>"

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict[str, Any]:
        return {"pools": dict(self.pools), "assignment": dict(self.assignment),
                "sizes": {m: {size: getattr(s, size) for size in SIZES} for m, s in self.sizes.items()},
                "engines": dict(self.engines),
                "zero_stages": dict(self.zero_stages), "devices_per_node": self.devices_per_node}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Placement:
        known = {"pools", "assignment", "sizes", "engines", "zero_stages", "devices_per_node"}
        if unknown := set(data) - known:
            raise ConfigError("placement", f"unknown keys {sorted(unknown)}; a placement has {sorted(known)}")
        sizes = {m: _sized(m, ParallelLayout(), s) for m, s in (data.get("sizes") or {}).items()}
        return cls(dict(data["pools"]), dict(data["assignment"]), sizes, dict(data.get("engines") or {}),
                   dict(data.get("zero_stages") or {}), int(data.get("devices_per_node", 0)))

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> Placement:
        """A placement from YAML text or a ``.yaml`` file."""
        is_file = isinstance(text_or_path, Path) or str(text_or_path).endswith((".yaml", ".yml"))
        text = Path(text_or_path).read_text() if is_file else str(text_or_path)
        return cls.from_dict(yaml.safe_load(text))

    # ------------------------------------------------------------------ checks
    def check_sizes(self) -> None:
        """Every model on a known pool whose devices its ``t * p`` divide (a ``ParallelLayout`` itself holds
        ``tg`` dividing ``t`` and ``pg`` dividing ``p``)."""
        for model, pool in self.assignment.items():
            if model not in ROLES:
                raise ConfigError(f"placement.{model}", f"unknown model; models are {ROLES}")
            if pool not in self.pools or self.pools[pool] < 1:
                with_devices = [name for name, devices in self.pools.items() if devices >= 1]
                raise ConfigError(f"placement.{model}", f"pool {pool!r} has no devices; pools: {self.pools}; "
                                  f"assign {model} to one of {with_devices} or give {pool!r} devices")
            sizes, devices = self.size_of(model), self.pools[pool]
            if devices % (sizes.t * sizes.p):
                raise ConfigError(f"placement.{model}", f"t*p = {sizes.t * sizes.p} does not divide the {devices} "
                                  f"devices of pool {pool!r}; use t*p in {divisors(devices)}")

    def check_memory(self, workload: Workload, hardware: HardwareProfile) -> None:
        """Each pool's models fit in one device's memory, with room for the actor's generation shard and one
        sequence of KV cache; the error names the pool, each model's share and the device's usable bytes."""
        self.check_sizes()
        capacity = hardware.memory_bytes * MEMORY_RESERVE
        for pool, models in self.used_pools().items():
            needs = {m: resident_bytes(m, workload.models[m], self.size_of(m), workload)
                     for m in models if m in workload.models}
            if "actor" in needs:
                actor, par = workload.models["actor"], self.size_of("actor")
                needs["actor"] += actor.params * workload.dtype_bytes * (1 / par.tg - 1 / (par.t * par.p)) + \
                    actor.kv_bytes_per_token(workload.dtype_bytes) * workload.sequence_tokens / par.tg
            total = sum(needs.values())
            if total > capacity:
                shares = ", ".join(f"{m} {self.size_of(m).label()} {b / GIB:.2f} GiB" for m, b in needs.items())
                raise ConfigError(f"placement.{pool}", f"the models on pool {pool!r} need {total / GIB:.2f} GiB"
                                  f" per device ({shares}) but each {hardware.name} device has {capacity / GIB:.2f} "
                                  "GiB usable; give the pool more devices, raise t or p, or move a model to "
                                  "another pool")

    def check_lab(self) -> None:
        """What the Lab can run: reference/reward/cost inside the actor's ranks, the reference sharded like the
        actor, pipeline stages for the actor's training only, TP only for the actor."""
        self.check_sizes()
        actor_pool = self.assignment.get("actor")
        for model, pool in self.assignment.items():
            if model in INSIDE_ACTOR and pool != actor_pool:
                raise ConfigError(f"placement.{model}", f"the Lab runs the {model} model inside the actor's ranks; "
                                  f"place it on the actor's pool {actor_pool!r}")
            self._check_stages(model)

    def _check_stages(self, model: str) -> None:
        """Generation on one pipeline stage; training stages for the actor, and the reference following them."""
        sizes, actor = self.size_of(model), self.size_of("actor")
        if sizes.pg > 1:
            raise ConfigError(f"placement.{model}", f"pg={sizes.pg}: the Lab's generation engines hold every layer "
                              "(the hybrid engine gathers the pipeline stages for generation); use pg=1")
        if model == "reference" and (sizes.t, sizes.p) != (actor.t, actor.p):
            raise ConfigError("placement.reference", f"the reference is sharded like the actor (t={actor.t}, "
                              f"p={actor.p}); set its t and p to the actor's")
        if sizes.p > 1 and model not in ("actor", "reference"):
            raise ConfigError(f"placement.{model}", f"p={sizes.p}: only the actor trains pipeline-parallel in the "
                              f"Lab (the reference follows it); use p=1 for the {model}")

    # ------------------------------------------------------------------ the Lab's config
    def overrides(self) -> list[str]:
        """The dotted overrides that turn a Lab config into this placement; pipeline stages (p > 1) also set what
        they run on: the torch engine, and passes over padded micro-batches of one shape."""
        actor = self.size_of("actor")
        items = [f"actor.engine.tensor_parallel={actor.t}", f"rollout.tensor_parallel={actor.tg}",
                 f"actor.engine.pipeline_parallel={actor.p}"]
        if actor.p > 1:
            items.append("actor.engine.remove_padding=false")
        for role in ("actor", "critic"):
            if role not in self.assignment:
                continue
            pool = self.assignment[role]
            items += [f"{role}.pool={pool}", f"{role}.ranks={self.pools[pool]}"]
            if backend := self._backend(role):
                items.append(f"{role}.engine.backend={backend}")
            if role in self.zero_stages:
                items.append(f"{role}.engine.zero_stage={self.zero_stages[role]}")
        return items

    def _backend(self, role: str) -> str | None:
        """``role``'s training backend as run: the torch engine for an actor in pipeline stages."""
        return "torch" if role == "actor" and self.size_of("actor").p > 1 else self.engines.get(role)

    def apply(self, config: LabConfig) -> LabConfig:
        """``config`` with this placement; raises ``ConfigError`` when it cannot work."""
        self.check_lab()
        placed = resolve_config(config, self.overrides())
        check_config(placed)
        return placed

    def problem(self, config: LabConfig, devices: int) -> str | None:
        """Why this placement cannot run on ``devices`` slots with ``config``, or None when it can."""
        if self.devices_needed() > devices:
            return (f"the pools need {self.devices_needed()} device slots ({self.pool_summary()}) but there are "
                    f"{devices}; shrink a pool or colocate roles on one pool")
        try:
            self.apply(config)
        except ConfigError as error:
            return str(error)
        return None

    def pool_size_choices(self, config: LabConfig, devices: int, pool: str) -> list[int]:
        """The slot counts of ``pool`` that make a valid placement, the other settings unchanged."""
        return [size for size in range(1, devices + 1)
                if self.with_changes(pools={**self.pools, pool: size}).problem(config, devices) is None]

    def tensor_parallel_choices(self, config: LabConfig, devices: int, which: str = "tg") -> list[int]:
        """The actor's generation (``which="tg"``) or training (``"t"``) TP sizes that make a valid placement."""
        return self._actor_size_choices(which, config, devices)

    def pipeline_choices(self, config: LabConfig, devices: int) -> list[int]:
        """The actor's pipeline stage counts (``p``) that make a valid placement."""
        return self._actor_size_choices("p", config, devices)

    def _actor_size_choices(self, which: str, config: LabConfig, devices: int) -> list[int]:
        actor_slots = self.pools[self.assignment["actor"]]
        return [size for size in range(1, actor_slots + 1)
                if self._actor_size_problem(which, size, config, devices) is None]

    def _actor_size_problem(self, which: str, size: int, config: LabConfig, devices: int) -> str | None:
        try:
            return self._with_actor_size(which, size).problem(config, devices)
        except ConfigError as error:  # a tg that does not divide t
            return str(error)

    def with_actor_tp(self, which: str, tp: int) -> Placement:
        """The actor's ``t`` or ``tg`` set to ``tp``; the reference follows the actor's ``t``."""
        return self._with_actor_size(which, tp)

    def with_actor_pipeline(self, p: int) -> Placement:
        """The actor's training in ``p`` pipeline stages (on the torch engine when p > 1); the reference follows."""
        placement = self._with_actor_size("p", p)
        if p > 1 and "actor" in placement.engines:
            placement = placement.with_changes(engines={**placement.engines, "actor": "torch"})
        return placement

    def _with_actor_size(self, which: str, size: int) -> Placement:
        """The actor's ``t``, ``tg`` or ``p`` set to ``size``; the reference follows the actor's ``t`` and ``p``."""
        placement = self.with_sizes("actor", **{which: size})
        if which in ("t", "p") and "reference" in self.assignment:
            actor = placement.size_of("actor")
            placement = placement.with_sizes("reference", t=actor.t, p=actor.p, tg=actor.t)
        return placement
