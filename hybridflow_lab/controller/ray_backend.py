"""The ray backend: one Ray actor per rank, placed in its resource-pool slot."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from hybridflow_lab.controller.errors import WorkerCallError, WorkerCallTimeout
from hybridflow_lab.controller.host import RankHost, RankInfo, Role
from hybridflow_lab.controller.interrupts import interrupts_held
from hybridflow_lab.controller.resource_pool import ResourcePool
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.telemetry import Span

RankCall = tuple[tuple[Any, ...], dict[str, Any]]
_SHAREABLE = (DataBatch, torch.Tensor, np.ndarray)
_RemoteHost = ray.remote(RankHost)


class RankHandle(NamedTuple):
    """What a submitted rank call gives back: its result and its spans (object refs here)."""

    rank: int
    result: Any
    spans: Any


class RayRanks:
    """Runs a group's ranks as Ray actors and moves calls and results through the object store."""

    kind = "ray"

    def __init__(self, pool: ResourcePool, infos: Sequence[RankInfo], poll_s: float = 0.5,
                 settle_s: float = 5.0, call_timeout_s: float | None = None) -> None:
        self.infos = list(infos)
        self.poll_s, self.settle_s, self.call_timeout_s = poll_s, settle_s, call_timeout_s
        self.actors = [_RemoteHost.options(**pool.actor_options(i.rank)).remote(i) for i in self.infos]
        self.offsets = [0.0] * len(self.actors)

    def start(self, roles: dict[str, Role]) -> None:
        """Rendezvous at rank 0's address, then construct the roles on every rank at once."""
        master = ray.get(self.actors[0].endpoint.remote())
        refs = [actor.start.remote(master, roles) for actor in self.actors]
        try:
            ray.get(refs)
        except RayError:
            handles = [RankHandle(i.rank, ref, None) for i, ref in zip(self.infos, refs, strict=True)]
            failures = self._failures(handles, refs, ", ".join(roles), "__init__")
            raise failures[0].with_others([f.rank for f in failures[1:]]) from None
        self.offsets = self._clock_offsets()

    def _clock_offsets(self, samples: int = 5) -> list[float]:
        """Worker clock minus controller clock per rank; 0 on the controller's own node."""
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([actor.node_id.remote() for actor in self.actors])
        offsets = []
        for actor, node in zip(self.actors, nodes, strict=True):
            pings = []
            for _ in range(samples if node != here else 0):
                sent = time.time()
                remote = ray.get(actor.clock.remote())
                pings.append((sent, remote, time.time()))
            offsets.append(clock_offset(pings))
        return offsets

    def submit(self, ranks: Sequence[int], role: str, method: str, calls: Sequence[RankCall]) -> list[RankHandle]:
        """Submit one call per rank; an object sent to several ranks is stored in Ray only once."""
        shared = _shared_payloads(calls)
        handles = []
        with interrupts_held():  # every rank gets the call, or none does
            for rank, (args, kwargs) in zip(ranks, calls, strict=True):
                args = tuple(shared.get(id(a), a) for a in args)
                kwargs = {k: shared.get(id(v), v) for k, v in kwargs.items()}
                result, spans = self.actors[rank].execute.remote(role, method, *args, **kwargs)
                handles.append(RankHandle(rank, result, spans))
        return handles

    def done(self, handles: Sequence[RankHandle]) -> bool:
        refs = [h.result for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def results(self, handles: Sequence[RankHandle], role: str, method: str) -> tuple[list[Any], list[Span]]:
        """Every rank's result and spans; raises one ``WorkerCallError`` soon after any rank has failed.

        The fast path is a single ``ray.get`` of all results and spans; while some ranks are still
        running, the ranks that finished are checked for errors every ``poll_s`` seconds, so a
        failed rank is reported even when its peers hang in a collective waiting for it (after
        ``settle_s`` more). A rank whose process died is named first: the others' errors usually follow from it.
        Ranks that have not answered after ``call_timeout_s`` raise ``WorkerCallTimeout`` naming them.
        """
        results = [h.result for h in handles]
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        while True:
            try:
                values = ray.get(results + [h.spans for h in handles], timeout=self.poll_s)
            except RayError:  # a timeout or a failed rank: look at the ranks that finished
                ready, _ = ray.wait(results, num_returns=len(results), timeout=0)
            else:
                return values[: len(handles)], self._aligned(handles, values[len(handles) :])
            failures = self._failures(handles, ready, role, method)
            if failures:
                # a rank that fails because a peer's process died (its collective's connection closed) reports
                # before Ray has noticed the death: give the others a moment, so the dead process is named
                ready, _ = ray.wait(results, num_returns=len(results), timeout=self.settle_s)
                failures = self._failures(handles, ready, role, method)
                self.spans(handles, block=False)  # fetch what arrived so Ray does not report it unhandled
                done = {ref.hex() for ref in ready}
                running = [h.rank for h in handles if h.result.hex() not in done]
                raise failures[0].with_others([f.rank for f in failures[1:]], running)
            if deadline is not None and time.monotonic() > deadline:
                done = {ref.hex() for ref in ready}
                silent = [h.rank for h in handles if h.result.hex() not in done]
                raise WorkerCallTimeout(self.infos[0].group, role, method, self.call_timeout_s, silent)

    def _failures(
        self, handles: Sequence[RankHandle], ready: list[Any], role: str, method: str
    ) -> list[WorkerCallError]:
        """The finished ranks' errors, the ranks whose process died first, each in rank order."""
        done = {ref.hex() for ref in ready}
        failures = []
        for handle in handles:
            if handle.result.hex() not in done:
                continue
            try:
                ray.get(handle.result, timeout=0)
            except GetTimeoutError:
                continue
            except RayError as exc:
                died = isinstance(exc, RayActorError)
                failures.append((not died, self._as_worker_error(exc, handle.rank, role, method)))
        return [failure for _, failure in sorted(failures, key=lambda pair: pair[0])]

    def _as_worker_error(self, exc: Exception, rank: int, role: str, method: str) -> WorkerCallError:
        group = self.infos[rank].group
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, WorkerCallError):
            return exc.cause
        if isinstance(exc, RayActorError):
            return WorkerCallError(group, role, rank, method, f"the worker process died: {exc}")
        return WorkerCallError(group, role, rank, method, f"{type(exc).__name__}: {exc}")

    def spans(self, handles: Sequence[RankHandle], block: bool) -> list[Span] | None:
        """The ranks' spans on the controller clock; None if not all arrived and ``block`` is False."""
        refs = [h.spans for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=None if block else 0)
        if len(ready) < len(refs):
            return None
        span_lists = []
        for ref in refs:
            try:
                span_lists.append(ray.get(ref))
            except RayError:
                span_lists.append([])  # a failed rank has no spans; results() raises its error
        return self._aligned(handles, span_lists)

    def _aligned(self, handles: Sequence[RankHandle], span_lists: list[list[Span]]) -> list[Span]:
        spans: list[Span] = []
        for handle, rank_spans in zip(handles, span_lists, strict=True):
            offset = self.offsets[handle.rank]
            spans += [replace(s, t_start=s.t_start - offset, t_end=s.t_end - offset) for s in rank_spans]
        return spans

    def node_addresses(self) -> list[str]:
        return ray.get([actor.node_address.remote() for actor in self.actors])

    def pids(self) -> list[int]:
        """Each rank's process id."""
        return ray.get([actor.__ray_call__.remote(lambda host: os.getpid()) for actor in self.actors])

    def memory(self, release: bool) -> list[dict[str, float]]:
        return ray.get([actor.memory.remote(release) for actor in self.actors])

    def shutdown(self) -> None:
        """Kill the rank actors (their processes and everything they hold go with them)."""
        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def clock_offset(pings: Sequence[tuple[float, float, float]]) -> float:
    """Remote clock minus local clock from ``(sent, remote time, received)`` pings (NTP style).

    The ping with the shortest round trip bounds the error best; no pings means the same clock.
    """
    if not pings:
        return 0.0
    sent, remote, received = min(pings, key=lambda p: p[2] - p[0])
    return remote - (sent + received) / 2


def _shared_payloads(calls: Sequence[RankCall]) -> dict[int, Any]:
    """Object refs for payload objects that more than one rank receives (``ONE_TO_ALL`` and ``MESH``)."""
    if len(calls) < 2:
        return {}
    seen: dict[int, int] = {}
    objects: dict[int, Any] = {}
    for args, kwargs in calls:
        for value in (*args, *kwargs.values()):
            if isinstance(value, _SHAREABLE):
                seen[id(value)] = seen.get(id(value), 0) + 1
                objects[id(value)] = value
    return {key: ray.put(objects[key]) for key, count in seen.items() if count > 1}
