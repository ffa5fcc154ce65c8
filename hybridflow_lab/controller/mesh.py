"""Named device meshes over a worker group's ranks, and the layout dispatch modes see."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DP, TP, PP = "dp", "tp", "pp"


@dataclass(frozen=True)
class Mesh:
    """Named axes over ranks, outermost first.

    ``Mesh.of(dp=2, tp=2)`` puts tensor-parallel peers on consecutive ranks (Megatron order):
    rank 0 = (dp 0, tp 0), rank 1 = (dp 0, tp 1), rank 2 = (dp 1, tp 0), ...
    ``ranks`` overrides the row-major order with any permutation (e.g. strided groups).
    """

    axes: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...] | None = None
    _coords: dict[int, dict[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names repeat: {names}")
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are whole numbers >= 1")
        order = self.ranks if self.ranks is not None else tuple(range(self.size))
        if sorted(order) != list(range(self.size)):
            raise ValueError(f"mesh ranks {list(order)} are not a permutation of range({self.size})")
        if tuple(order) == tuple(range(self.size)):  # row-major given explicitly is the same mesh as no order
            object.__setattr__(self, "ranks", None)
        coords = {}
        for position, rank in enumerate(order):
            coords[rank] = dict(zip(names, _unravel(position, self.shape), strict=True))
        object.__setattr__(self, "_coords", coords)

    @classmethod
    def of(cls, **sizes: int) -> Mesh:
        """A row-major mesh with the axes in keyword order, e.g. ``Mesh.of(dp=2, tp=2)``."""
        return cls(tuple(sizes.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """Size of axis ``name``; 1 for an axis the mesh does not have."""
        return dict(self.axes).get(name, 1)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis."""
        return dict(self._coords[rank])

    def coord(self, rank: int, name: str) -> int:
        return self._coords[rank].get(name, 0)

    def rank_at(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes count as 0)."""
        wanted = {name: coords.get(name, 0) for name in self.names}
        for rank, at in self._coords.items():
            if at == wanted:
                return rank
        raise ValueError(f"no rank at {coords} in a mesh of shape {dict(self.axes)}")

    def groups(self, name: str) -> list[list[int]]:
        """The rank groups along axis ``name``: ranks that agree on every other axis, in axis order."""
        others = [n for n in self.names if n != name]
        buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for rank, at in self._coords.items():
            buckets.setdefault(tuple(at[n] for n in others), []).append((at.get(name, 0), rank))
        return [[rank for _, rank in sorted(members)] for _, members in sorted(buckets.items())]

    def layout(self) -> list[int]:
        """Ranks in row-major mesh order (what ``torch.distributed.DeviceMesh`` takes, reshaped)."""
        return list(self.ranks) if self.ranks is not None else list(range(self.size))

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes)


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        position, rem = divmod(position, size)
        coords.append(rem)
    return tuple(reversed(coords))


@dataclass(frozen=True)
class GroupLayout:
    """What dispatch modes know about a group: its size and its named meshes."""

    world_size: int
    meshes: Mapping[str, Mesh] = field(default_factory=dict)

    def mesh(self, name: str) -> Mesh:
        if name not in self.meshes:
            have = ", ".join(self.meshes) or "none"
            raise KeyError(f"the group has no mesh named {name!r} (meshes: {have}); pass meshes={{{name!r}: ...}}")
        return self.meshes[name]


def validate_meshes(meshes: Mapping[str, Mesh], world_size: int, group: str) -> None:
    """Every mesh must cover exactly the group's ranks; raise naming the mesh and the fix."""
    for name, mesh in meshes.items():
        if not isinstance(mesh, Mesh):
            raise TypeError(f"group {group!r}: mesh {name!r} is a {type(mesh).__name__}, expected a Mesh")
        if mesh.size != world_size:
            raise ValueError(
                f"group {group!r}: mesh {name!r} ({mesh.describe()}) covers {mesh.size} ranks but the group has "
                f"{world_size}; make the product of the axis sizes equal the pool's {world_size} slots"
            )
