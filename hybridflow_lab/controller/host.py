"""The rank process: sets up torch.distributed and the meshes, builds the roles, runs calls.

The same ``RankHost`` class runs inside a Ray actor (ray backend) or in the controller's
own process (local backend).
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from hybridflow_lab.controller.devices import rank_device
from hybridflow_lab.controller.errors import WorkerCallError
from hybridflow_lab.controller.futures import RemoteRows
from hybridflow_lab.controller.memory import HeapRelease, PhaseMemory, memory_report
from hybridflow_lab.controller.mesh import Mesh
from hybridflow_lab.controller.worker import Worker, WorkerContext
from hybridflow_lab.protocol import DataBatch, payload_nbytes
from hybridflow_lab.telemetry import Phase, Span


def collective_backend(device: str) -> str:
    """The process group's backends for a rank on ``device``: NCCL for GPU tensors, gloo for CPU ones."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


class Role:
    """A worker class and its constructor arguments: ``Role(ActorWorker, config, lr=1e-5)``."""

    __slots__ = ("args", "cls", "kwargs")

    def __init__(self, cls: type[Worker], /, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"a role needs a Worker subclass, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __repr__(self) -> str:
        return f"Role({self.cls.__name__})"


@dataclass(frozen=True)
class RankInfo:
    """Everything a rank process needs to know before it starts."""

    group: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    meshes: dict[str, Mesh]
    device: str = "cpu"  # "cpu", "cuda" (the rank's GPU) or "cuda:<i>" (the local backend's pick)
    threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    collective_timeout_s: float = 600.0


class RankHost:
    """Hosts every role of one rank in one process (colocation) and executes registered calls."""

    def __init__(self, info: RankInfo) -> None:
        os.environ.update(info.env)
        if info.threads:
            torch.set_num_threads(info.threads)
        self.info = info
        self.roles: dict[str, Worker] = {}
        self.contexts: dict[str, WorkerContext] = {}
        # local parts are the producer's own objects: copy them as a process boundary would
        self._fetch: Callable[[list[Any]], list[Any]] = ray.get if info.backend == "ray" else copy.deepcopy
        self._store: dist.TCPStore | None = None  # the group's rendezvous: opened by rank 0's endpoint()
        self.heap = HeapRelease()

    def endpoint(self) -> tuple[str, int]:
        """Open the group's rendezvous store on this rank (rank 0) and return its address and port.

        The store listens from here on, on a port the OS picks: a port found free and bound later
        could be taken meanwhile by any process on the node (EADDRINUSE when the group starts).
        """
        self._store = dist.TCPStore("0.0.0.0", 0, self.info.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.info.collective_timeout_s))
        return self.node_address(), self._store.port

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id() if self.info.backend == "ray" else "local"

    def node_address(self) -> str:
        """The address this rank's node is reached at (the controller's loopback on the local backend)."""
        return ray.util.get_node_ip_address() if self.info.backend == "ray" else "127.0.0.1"

    def clock(self) -> float:
        return time.time()

    def start(self, master: tuple[str, int] | None, roles: dict[str, Role]) -> None:
        """Join the group's process group, build its meshes, then construct every role."""
        info = self.info
        try:
            device = rank_device(info.device, info.backend)
        except (RuntimeError, ValueError) as exc:
            raise self._error(", ".join(roles), "__init__", exc) from exc
        distributed = self._init_distributed(master, device)
        device_meshes = self._build_device_meshes(device) if distributed else {}
        for name, spec in roles.items():
            context = WorkerContext(
                group=info.group, role=name, rank=info.rank, world_size=info.world_size,
                local_rank=info.local_rank, local_world_size=info.local_world_size, device=device,
                backend=info.backend, meshes=info.meshes, distributed=distributed, device_meshes=device_meshes,
            )
            try:
                worker = spec.cls.__new__(spec.cls)
                worker._context = context
                worker.__init__(*spec.args, **spec.kwargs)
            except Exception as exc:
                raise self._error(name, "__init__", exc) from exc
            self.roles[name], self.contexts[name] = worker, context

    def _init_distributed(self, master: tuple[str, int] | None, device: str) -> bool:
        info = self.info
        if info.backend == "local":
            if info.world_size > 1:
                return False  # ranks run one after another: collectives would deadlock
            if not dist.is_initialized():  # the first local group decides: gloo would copy CUDA tensors via the host
                dist.init_process_group(collective_backend(device), store=dist.HashStore(), rank=0, world_size=1)
            for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
                os.environ.setdefault(key, value)  # what launchers set and DeepSpeed reads
            return True
        assert master is not None
        addr, port = master
        # Ray shows a GPU rank only its own device: DeepSpeed and vLLM pick cuda:LOCAL_RANK, which must be 0
        local_rank = 0 if device.startswith("cuda") else info.local_rank
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(info.rank),
                          WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(info.local_world_size))
        timeout = timedelta(seconds=info.collective_timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(collective_backend(device), store=self._store, rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
        return True

    def _build_device_meshes(self, device: str) -> dict[str, Any]:
        from torch.distributed.device_mesh import DeviceMesh

        kind = device.split(":")[0]
        return {
            name: DeviceMesh(kind, torch.tensor(mesh.layout()).view(mesh.shape), mesh_dim_names=mesh.names)
            for name, mesh in self.info.meshes.items()
        }

    @ray.method(num_returns=2)
    def execute(self, role: str, method: str, /, *raw_args: Any, **raw_kwargs: Any) -> tuple[Any, list[Span]]:
        """Run ``role.method`` on this rank; returns its result and the spans recorded meanwhile.

        Arguments are passed flat so that Ray resolves object refs among them before the call;
        rows held by another group (``RemoteRows``) are fetched here, in a TRANSFER span.
        """
        context = self.contexts[role]
        recorder, device = context.recorder, context.device
        where = {"group": self.info.group, "role": role, "rank": self.info.rank}
        spans: list[Span] = []
        try:
            fetch_start = time.time()
            args = tuple(self._resolve(a, device) for a in raw_args)
            kwargs = {k: self._resolve(v, device) for k, v in raw_kwargs.items()}
            memory = PhaseMemory(device)
            start = time.time()
            bytes_in = payload_nbytes(args) + payload_nbytes(kwargs)
            remote = [new for new, old in zip((*args, *kwargs.values()), (*raw_args, *raw_kwargs.values()), strict=True)
                      if isinstance(old, RemoteRows)]
            if remote:
                spans.append(Span(f"{method}:fetch", Phase.TRANSFER, fetch_start, start,
                                  bytes_moved=payload_nbytes(remote), **where))
            result = getattr(self.roles[role], method)(*args, **kwargs)
            result = result.to("cpu") if isinstance(result, DataBatch) else result
        except Exception as exc:
            recorder.drain()
            raise self._error(role, method, exc) from exc
        end = time.time()
        if device.startswith("cuda"):
            # what the call's temporaries left cached goes back to the GPU (as verl's workers do after each
            # compute): a colocated group, and vLLM waking its KV cache, can only use memory no process caches
            torch.cuda.empty_cache()
        bytes_out = payload_nbytes(result)
        spans.append(Span(method, Phase.EXECUTE, start, end, bytes_moved=bytes_in + bytes_out,
                          attrs={"bytes_in": bytes_in, "bytes_out": bytes_out, **memory.fields()}, **where))
        spans += [replace(s, **where) for s in recorder.drain()]
        self.heap.after_call()
        return result, spans

    def _resolve(self, value: Any, device: str) -> Any:
        """An argument as the worker sees it: rows another group holds fetched, every batch on ``device``."""
        if isinstance(value, RemoteRows):
            parts = self._fetch(value.parts)
            for part in parts:
                if not isinstance(part, DataBatch):
                    raise TypeError(f"expected DataBatch rows from {value.source}, got a {type(part).__name__}")
            value = parts[0] if len(parts) == 1 else DataBatch.concat(parts)
        return value.to(device) if isinstance(value, DataBatch) else value

    def _error(self, role: str, method: str, exc: Exception) -> WorkerCallError:
        return WorkerCallError(self.info.group, role, self.info.rank, method, f"{type(exc).__name__}: {exc}",
                               traceback.format_exc())

    def memory(self, release: bool = False) -> dict[str, float]:
        """This rank's process memory (``controller.memory.memory_report``)."""
        return memory_report(release)

    def shutdown(self) -> None:
        """Leave the process group (ray backend; the local backend shares the controller's)."""
        if self.info.backend == "ray" and dist.is_initialized():
            dist.destroy_process_group()
