"""The local backend: every rank runs in the controller's process, one after another.

Same API as the ray backend, so a breakpoint inside a worker method stops the notebook.
Arguments and results are deep-copied, as they would be by crossing a process boundary,
so code that works here does not rely on sharing memory with the controller.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

from hybridflow_lab.controller.errors import WorkerCallError
from hybridflow_lab.controller.host import RankHost, RankInfo, Role
from hybridflow_lab.controller.ray_backend import RankCall, RankHandle
from hybridflow_lab.telemetry import Span


class LocalRanks:
    """Runs each rank's ``RankHost`` in this process; calls execute when submitted."""

    kind = "local"

    def __init__(self, infos: Sequence[RankInfo]) -> None:
        self.hosts = [RankHost(info) for info in infos]

    def start(self, roles: dict[str, Role]) -> None:
        for host in self.hosts:
            host.start(None, roles)

    def submit(self, ranks: Sequence[int], role: str, method: str, calls: Sequence[RankCall]) -> list[RankHandle]:
        handles = []
        for rank, (args, kwargs) in zip(ranks, calls, strict=True):
            try:
                result, spans = self.hosts[rank].execute(role, method, *copy.deepcopy(args), **copy.deepcopy(kwargs))
                handles.append(RankHandle(rank, copy.deepcopy(result), spans))
            except WorkerCallError as error:
                handles.append(RankHandle(rank, error, []))
        return handles

    def done(self, handles: Sequence[RankHandle]) -> bool:
        return True

    def results(self, handles: Sequence[RankHandle], role: str, method: str) -> tuple[list[Any], list[Span]]:
        failures = [h.result for h in handles if isinstance(h.result, WorkerCallError)]
        if failures:
            raise failures[0].with_others([f.rank for f in failures[1:]]) from failures[0].__cause__
        return [h.result for h in handles], self.spans(handles, block=True)

    def spans(self, handles: Sequence[RankHandle], block: bool) -> list[Span]:
        return [span for h in handles for span in h.spans]

    def pids(self) -> list[int]:
        return [os.getpid()] * len(self.hosts)

    def node_addresses(self) -> list[str]:
        return [host.node_address() for host in self.hosts]

    def memory(self, release: bool) -> list[dict[str, float]]:
        return [host.memory(release) for host in self.hosts]

    def shutdown(self) -> None:
        self.hosts = []
