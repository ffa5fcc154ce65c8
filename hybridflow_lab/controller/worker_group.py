"""``WorkerGroup``: the controller's handle to one multi-controller SPMD program.

A group runs one process per rank (on a resource pool) hosting one or more roles.
Every ``@register``-ed method of a role becomes a controller-side method that splits its
arguments across ranks, runs them, and merges the results by the method's transfer protocol.
"""

from __future__ import annotations

import inspect
import itertools
import re
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import ray

from hybridflow_lab.controller.cluster import init_cluster
from hybridflow_lab.controller.decorator import Execute, MethodSpec, registered_methods
from hybridflow_lab.controller.dispatch import Split
from hybridflow_lab.controller.errors import WorkerGroupClosed
from hybridflow_lab.controller.futures import DataBatchFuture
from hybridflow_lab.controller.host import RankInfo, Role
from hybridflow_lab.controller.local_backend import LocalRanks
from hybridflow_lab.controller.mesh import GroupLayout, Mesh, validate_meshes
from hybridflow_lab.controller.ray_backend import RankHandle, RayRanks
from hybridflow_lab.controller.resource_pool import ResourcePool
from hybridflow_lab.controller.worker import Worker
from hybridflow_lab.protocol import payload_nbytes
from hybridflow_lab.telemetry import Phase, Span, TelemetryStore, default_store

BackendName = Literal["ray", "local"]
RolesArg = type[Worker] | Role | Mapping[str, "type[Worker] | Role"]

_call_ids = itertools.count(1)
_live_groups: dict[str, weakref.ref[WorkerGroup]] = {}


class WorkerGroup:
    """One model's ranks, driven from the controller.

    ``WorkerGroup(MyWorker, pool)`` exposes ``MyWorker``'s registered methods on the group;
    ``WorkerGroup({"actor": ActorWorker, "ref": RefWorker}, pool)`` colocates both roles in
    each rank's process and exposes them as ``group.actor.<method>`` and ``group.ref.<method>``.
    Building a group with the ``name`` of a live one replaces it (re-running a notebook cell).
    Its ranks put their tensors on ``device`` (default: the pool's GPUs when it has them, else ``"cpu"``;
    see ``controller.devices.rank_device``); a device a rank cannot use fails the group's start.
    ``threads_per_rank`` (default: 1 for a Ray rank, a process of its own sharing the machine's cores; none set
    for local ranks, which run one after another in the controller's process and keep its thread count).
    ``call_timeout_s``: a Ray call whose ranks have not all answered by then raises ``WorkerCallTimeout`` naming
    them (local ranks run in the caller's thread, so a hang there is the caller's).
    """

    def __new__(cls, roles: RolesArg, *args: Any, **kwargs: Any) -> WorkerGroup:
        normalised = _normalise_roles(roles)
        single = not isinstance(roles, Mapping)
        return super().__new__(_group_class(tuple((n, r.cls) for n, r in normalised.items()), single))

    def __init__(
        self,
        roles: RolesArg,
        pool: ResourcePool | None = None,
        *,
        name: str | None = None,
        backend: BackendName = "ray",
        meshes: Mapping[str, Mesh] | None = None,
        telemetry: TelemetryStore | None = None,
        threads_per_rank: int | None = None,
        env: Mapping[str, str] | None = None,
        collective_timeout_s: float = 600.0,
        device: str | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        if backend not in ("ray", "local"):
            raise ValueError(f"backend must be 'ray' or 'local', got {backend!r}")
        self.roles: dict[str, Role] = _normalise_roles(roles)
        self.methods: dict[str, dict[str, MethodSpec]] = {n: registered_methods(r.cls) for n, r in self.roles.items()}
        self.pool = pool or ResourcePool(1)
        self.name = name or _unique_name("+".join(self.roles))
        self.backend_name = backend
        self.layout = GroupLayout(self.pool.world_size, dict(meshes or {}))
        self.telemetry = telemetry if telemetry is not None else default_store()
        self._validate()
        _replace_live_group(self.name)

        infos = self._rank_infos(threads_per_rank, dict(env or {}), collective_timeout_s, device)
        if backend == "ray":
            init_cluster()
            self._backend: RayRanks | LocalRanks = RayRanks(self.pool, infos, call_timeout_s=call_timeout_s)
        else:
            self._backend = LocalRanks(infos)
        self._inflight: weakref.WeakSet[PendingCall] = weakref.WeakSet()
        unpoll = self.telemetry.add_poller(_weak_poller(self))
        self.pool.attach()
        self._finalizer = weakref.finalize(self, _close, self._backend, unpoll, self.name, self.pool)
        _live_groups[self.name] = weakref.ref(self)
        try:
            self._backend.start(self.roles)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ set-up
    def _validate(self) -> None:
        """Everything checkable before a worker starts: meshes cover the ranks, dispatch modes fit."""
        validate_meshes(self.layout.meshes, self.layout.world_size, self.name)
        for role, methods in self.methods.items():
            for spec in methods.values():
                try:
                    spec.dispatch.validate(self.layout)
                except (KeyError, ValueError) as exc:
                    message = exc.args[0] if exc.args else str(exc)
                    where = f"group {self.name!r}: {role}.{spec.name} uses {spec.dispatch}"
                    raise ValueError(f"{where}: {message}") from None

    def _rank_infos(self, threads: int | None, env: dict[str, str], timeout_s: float,
                    device: str | None) -> list[RankInfo]:
        if device is None:
            use_gpu = self.pool.resolve_gpu() if self.backend_name == "ray" else bool(self.pool.use_gpu)
            device = "cuda" if use_gpu else "cpu"
        if threads is None and self.backend_name == "ray":
            threads = 1
        env = {"TOKENIZERS_PARALLELISM": "false", **({"OMP_NUM_THREADS": str(threads)} if threads else {}), **env}
        return [
            RankInfo(
                group=self.name, rank=rank, world_size=self.world_size, local_rank=local,
                local_world_size=self.pool.nodes[node], backend=self.backend_name, meshes=dict(self.layout.meshes),
                device=device, threads=threads, env=env, collective_timeout_s=timeout_s,
            )
            for rank, (node, local) in enumerate(self.pool.rank_slots())
        ]

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def pids(self) -> list[int]:
        """The process id of each rank (the controller's own on the local backend)."""
        return self._backend.pids()

    def node_addresses(self) -> list[str]:
        """The address of each rank's node (its Ray node IP; loopback on the local backend)."""
        return self._backend.node_addresses()

    def memory(self, release: bool = False) -> list[dict[str, float]]:
        """Each rank's resident MiB and live Python objects (``controller.memory.memory_report``)."""
        return self._backend.memory(release)

    @property
    def meshes(self) -> Mapping[str, Mesh]:
        return self.layout.meshes

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # -------------------------------------------------------------------- calls
    def _call(self, role: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.closed:
            raise WorkerGroupClosed(f"worker group {self.name!r} was shut down; build a new one")
        label = f"{self.name}.{role}.{spec.name}" if len(self.roles) > 1 else f"{self.name}.{spec.name}"
        args, kwargs = _bind(spec, args, kwargs, label)
        start = time.time()
        try:
            split = spec.dispatch.split(self.layout, args, kwargs)
        except (TypeError, ValueError, KeyError) as exc:
            message = exc.args[0] if exc.args else str(exc)
            raise type(exc)(f"{label}: {message}") from None
        ranks = [0] if spec.execute is Execute.RANK_ZERO else list(range(self.world_size))
        calls = [split.per_rank[r] for r in ranks]
        handles = self._backend.submit(ranks, role, spec.name, calls)
        call = PendingCall(self, role, spec, split, handles, label, next(_call_ids), self.telemetry.step, start)
        self._record(call, Phase.DISPATCH, start, time.time(), sum(payload_nbytes(c) for c in calls))
        self._inflight.add(call)
        future = DataBatchFuture(call)
        return future.get() if spec.blocking else future

    def _record(self, call: PendingCall, phase: Phase, start: float, end: float, nbytes: int = 0, **attrs: Any) -> None:
        span = Span(call.spec.name, phase, start, end, group=self.name, role=call.role, step=call.step,
                    bytes_moved=nbytes, call_id=call.call_id, attrs=attrs)
        self.telemetry.record([span])

    def poll_telemetry(self) -> None:
        """Record the worker spans of finished calls whose results nobody fetched yet (never blocks)."""
        for call in list(self._inflight):
            if call.record_worker_spans(block=False):
                self._inflight.discard(call)

    # ---------------------------------------------------------------- lifetime
    def shutdown(self) -> None:
        """Stop every rank's process. Calls afterwards raise ``WorkerGroupClosed``."""
        self._finalizer()
        if (ref := _live_groups.get(self.name)) and ref() is self:
            del _live_groups[self.name]

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        roles = ", ".join(f"{n}={r.cls.__name__}[{', '.join(self.methods[n])}]" for n, r in self.roles.items())
        meshes = "".join(f"; mesh {n}: {m.describe()}" for n, m in self.meshes.items())
        state = "closed" if self.closed else f"{self.world_size} ranks"
        return f"WorkerGroup({self.name!r}, {self.backend_name}, {state}; roles: {roles}{meshes})"


@dataclass(eq=False)
class PendingCall:
    """A submitted call: its handles, how to merge them, and its telemetry bookkeeping."""

    group: WorkerGroup
    role: str
    spec: MethodSpec
    split: Split
    handles: list[RankHandle]
    label: str
    call_id: int
    step: int | None
    t_start: float
    spans_recorded: bool = field(default=False)

    def done(self) -> bool:
        return self.group._backend.done(self.handles)

    def finish(self) -> Any:
        """Wait for the ranks, record their spans, merge their outputs."""
        group, spec = self.group, self.spec
        waited = time.time()
        try:
            outputs, spans = group._backend.results(self.handles, self.role, spec.name)
        except BaseException:
            self.record_worker_spans(block=False)
            raise
        self._record_spans(spans)
        if spec.execute is Execute.RANK_ZERO:
            result = outputs[0]
        else:
            result = spec.dispatch.collect(group.layout, outputs, self.split)
        end = time.time()
        group._record(self, Phase.COLLECT, waited, end, payload_nbytes(result))
        group._record(self, Phase.CALL, self.t_start, end, dispatch=str(spec.dispatch), execute=spec.execute.value,
                      ranks=len(self.handles))
        return result

    def record_worker_spans(self, block: bool) -> bool:
        """Move the ranks' spans into the telemetry store once; True when they have been recorded."""
        if self.spans_recorded:
            return True
        spans = self.group._backend.spans(self.handles, block)
        if spans is None:
            return False
        self._record_spans(spans)
        return True

    def _record_spans(self, spans: list[Span]) -> None:
        if not self.spans_recorded:
            self.spans_recorded = True
            self.group.telemetry.record([replace(s, step=self.step, call_id=self.call_id) for s in spans])

    def concat_handles(self) -> list[Any] | None:
        """Result handles whose row concatenation is the call's result, or None if it is not one."""
        split = self.split
        if self.spec.execute is Execute.RANK_ZERO or split.concat_ranks is None or split.pad:
            return None
        by_rank = {h.rank: h.result for h in self.handles}
        return [by_rank[r] for r in split.concat_ranks]


class RoleHandle:
    """The methods of one colocated role: ``group.actor.update(...)``."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    def _call(self, role: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._group._call(role, spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<role of {self._group.name!r}: {', '.join(m for m in vars(type(self)) if not m.startswith('_'))}>"


# ----------------------------------------------------------------- helpers
def _normalise_roles(roles: RolesArg) -> dict[str, Role]:
    if isinstance(roles, Mapping):
        if not roles:
            raise ValueError("a worker group needs at least one role")
        return {name: r if isinstance(r, Role) else Role(r) for name, r in roles.items()}
    role = roles if isinstance(roles, Role) else Role(roles)
    return {_snake_case(role.cls.__name__): role}


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_group_classes: dict[tuple[tuple[tuple[str, type], ...], bool], type[WorkerGroup]] = {}


def _group_class(roles: tuple[tuple[str, type], ...], single: bool) -> type[WorkerGroup]:
    """A WorkerGroup subclass whose methods are the roles' registered methods (cached)."""
    key = (roles, single)
    if key not in _group_classes:
        if single:
            role, cls = roles[0]
            attrs = _proxies(role, cls)
            _require_free(attrs, WorkerGroup, f"worker class {cls.__name__}")
            _group_classes[key] = type(f"{cls.__name__}Group", (WorkerGroup,), attrs)
        else:
            handles = {role: type(f"{c.__name__}Role", (RoleHandle,), _proxies(role, c)) for role, c in roles}
            _require_free(handles, WorkerGroup, "role names")
            attrs = {role: property(_handle_getter(h), doc=f"The {role!r} role.") for role, h in handles.items()}
            _group_classes[key] = type("ColocatedWorkerGroup", (WorkerGroup,), attrs)
    return _group_classes[key]


def _handle_getter(handle_cls: type[RoleHandle]) -> Callable[[WorkerGroup], RoleHandle]:
    return lambda group: handle_cls(group)


_INSTANCE_ATTRS = frozenset({"roles", "methods", "pool", "name", "backend_name", "layout", "telemetry"})


def _require_free(names: Mapping[str, Any], base: type, what: str) -> None:
    clashes = sorted(n for n in names if hasattr(base, n) or n in _INSTANCE_ATTRS or n.startswith("_"))
    if clashes:
        raise ValueError(f"{what} {clashes} clash with WorkerGroup's own attributes; rename them")


def _proxies(role: str, cls: type) -> dict[str, Callable[..., Any]]:
    return {name: _proxy(role, spec) for name, spec in registered_methods(cls).items()}


def _proxy(role: str, spec: MethodSpec) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call(role, spec, args, kwargs)

    call.__name__ = call.__qualname__ = spec.name
    call.__doc__ = spec.doc
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    call.__signature__ = spec.signature.replace(parameters=[self_param, *spec.signature.parameters.values()])  # type: ignore[attr-defined]
    return call


_KEEP_AS_GIVEN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _bind(spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any], label: str) -> tuple[tuple, dict]:
    """Check the call against the worker method's signature; name every argument when possible."""
    try:
        bound = spec.signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{label}{spec.signature}: {exc}") from None
    if any(p.kind in _KEEP_AS_GIVEN for p in spec.signature.parameters.values()):
        return args, kwargs
    return (), dict(bound.arguments)


def _unique_name(base: str) -> str:
    name, n = base, 1
    while name in _live_groups and _live_groups[name]() is not None:
        n += 1
        name = f"{base}-{n}"
    return name


def _replace_live_group(name: str) -> None:
    existing = _live_groups.get(name)
    group = existing() if existing else None
    if group is not None:
        group.shutdown()


def _weak_poller(group: WorkerGroup) -> Callable[[], None]:
    ref = weakref.ref(group)

    def poll() -> None:
        live = ref()
        if live is not None and not live.closed:
            live.poll_telemetry()

    return poll


def _close(backend: RayRanks | LocalRanks, unpoll: Callable[[], None], name: str, pool: ResourcePool) -> None:
    unpoll()
    backend.shutdown()
    pool.detach()
    if name in _live_groups and _live_groups[name]() is None:
        del _live_groups[name]


def live_groups() -> list[WorkerGroup]:
    """Worker groups of this controller that are still running."""
    groups = [ref() for ref in _live_groups.values()]
    return [g for g in groups if g is not None and not g.closed]


def shutdown_all() -> None:
    """Shut down every live worker group of this controller."""
    for group in live_groups():
        group.shutdown()
    _live_groups.clear()


def shutdown_cluster() -> None:
    """Stop every worker group of this controller and disconnect from Ray."""
    shutdown_all()
    if ray.is_initialized():
        ray.shutdown()
