"""``Worker``: the base class of one rank of one role in a worker group."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow_lab.controller.mesh import Mesh
from hybridflow_lab.telemetry import Phase, SpanRecorder

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class WorkerContext:
    """Where a rank sits: its group, rank, node and meshes, and the process-wide handles it shares."""

    group: str
    role: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str
    backend: str
    meshes: dict[str, Mesh]
    distributed: bool
    recorder: SpanRecorder = field(default_factory=SpanRecorder)
    device_meshes: dict[str, DeviceMesh] = field(default_factory=dict)


class Worker:
    """One rank of a role. Subclass it and mark controller-callable methods with ``@register``.

    The context (rank, world size, meshes) is set before ``__init__`` runs, so a subclass's
    constructor can already use ``self.rank`` and, on the ray backend, collectives.
    """

    _context: WorkerContext

    @property
    def context(self) -> WorkerContext:
        return self._context

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def local_rank(self) -> int:
        return self._context.local_rank

    @property
    def role(self) -> str:
        return self._context.role

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:<i>"``: where this rank's tensors go."""
        return self._context.device

    @property
    def distributed(self) -> bool:
        """Whether ``torch.distributed`` is set up for this group (ray backend, or a local single rank)."""
        return self._context.distributed

    def mesh(self, name: str) -> Mesh:
        if name not in self._context.meshes:
            raise KeyError(f"no mesh named {name!r}; this group has: {', '.join(self._context.meshes) or 'none'}")
        return self._context.meshes[name]

    def mesh_coords(self, name: str) -> dict[str, int]:
        """This rank's coordinate on each axis of mesh ``name``, e.g. ``{"dp": 1, "tp": 0}``."""
        return self.mesh(name).coords(self.rank)

    def device_mesh(self, name: str) -> DeviceMesh:
        """The torch ``DeviceMesh`` of mesh ``name``: process groups per axis (``.get_group("tp")``)."""
        self.mesh(name)
        if name not in self._context.device_meshes:
            raise RuntimeError(
                f"mesh {name!r} has no process groups: the {self._context.backend} backend with "
                f"{self.world_size} ranks runs without torch.distributed; use backend='ray'"
            )
        return self._context.device_meshes[name]

    def span(self, name: str, bytes_moved: int = 0, phase: Phase = Phase.WORKER,
             **attrs: Any) -> AbstractContextManager[dict[str, Any]]:
        """Record a telemetry span around a block of this method (sent back with the call's result).

        ``phase=Phase.TRANSFER`` marks data moving between layouts (drawn hatched on the timeline).
        """
        return self._context.recorder.span(name, bytes_moved, phase, **attrs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, rank={self.rank}/{self.world_size})"

