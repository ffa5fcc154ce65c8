"""Transfer protocols: how a call's arguments are split across ranks and the results merged.

A ``DispatchMode`` turns one controller-side call into one ``(args, kwargs)`` per rank
(``split``) and the ranks' outputs back into one value (``collect``). The built-in modes
are in ``Dispatch``; users add their own with ``register_dispatch_mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow_lab.controller.futures import DataBatchFuture, RemoteRows
from hybridflow_lab.controller.mesh import DP, PP, GroupLayout, Mesh
from hybridflow_lab.protocol import DataBatch

RankCall = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Split:
    """One call split across ranks.

    ``concat_ranks`` is set when the merged result is the row concatenation of those
    ranks' outputs (in that order) without the last ``pad`` input rows; a future of such a
    call can feed another group's ranks directly.
    """

    per_rank: list[RankCall]
    pad: int = 0
    rows: int = 0
    concat_ranks: list[int] | None = None


class DispatchMode:
    """A transfer protocol. Subclass it, override ``split`` and ``collect``, and register it."""

    name = "custom"

    def validate(self, layout: GroupLayout) -> None:
        """Raise if this mode cannot work on a group with ``layout`` (checked before workers start)."""

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        raise NotImplementedError

    def collect(self, layout: GroupLayout, outputs: list[Any], split: Split) -> Any:
        return outputs

    def __repr__(self) -> str:
        return f"Dispatch.{self.name}"


class OneToAll(DispatchMode):
    """Every rank gets the same arguments; the result is the list of all ranks' outputs."""

    name = "ONE_TO_ALL"

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        args = tuple(_whole(value) for value in args)
        kwargs = {key: _whole(value) for key, value in kwargs.items()}
        return Split([(args, kwargs)] * layout.world_size)


class AllToAll(DispatchMode):
    """Each argument is a list with one entry per rank; the result is the list of outputs."""

    name = "ALL_TO_ALL"

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        world = layout.world_size
        named = [(k, v.get() if isinstance(v, DataBatchFuture) else v) for k, v in _named(args, kwargs)]
        for key, value in named:
            if not isinstance(value, (list, tuple)) or len(value) != world:
                length = f" of length {len(value)}" if hasattr(value, "__len__") else ""
                raise TypeError(
                    f"ALL_TO_ALL expects every argument to be a list with one entry per rank ({world} ranks); "
                    f"argument {key!r} is a {type(value).__name__}{length}"
                )
        positional = [v for _, v in named[: len(args)]]
        keyword = dict(named[len(args) :])
        return Split([(tuple(a[r] for a in positional), {k: v[r] for k, v in keyword.items()}) for r in range(world)])


class DPCompute(DispatchMode):
    """Split DataBatch arguments by rows across all ranks (padding if needed); concat results."""

    name = "DP_COMPUTE"

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        parts, pad, rows = split_rows(args, kwargs, layout.world_size, self.name)
        return Split(parts, pad, rows, concat_ranks=list(range(layout.world_size)))

    def collect(self, layout: GroupLayout, outputs: list[Any], split: Split) -> Any:
        return concat_outputs(outputs, split, self.name)


class MeshDispatch(DispatchMode):
    """The paper's 3D protocol over a named mesh.

    Rows are split along the mesh's data-parallel axis and replicated along the others
    (tp, pp); results are taken from one rank per data-parallel group (tp = 0, last pp stage).
    """

    def __init__(self, mesh: str, dp_axis: str = DP) -> None:
        self.mesh_name = mesh
        self.dp_axis = dp_axis
        self.name = f"MESH({mesh!r})"

    def validate(self, layout: GroupLayout) -> None:
        layout.mesh(self.mesh_name)

    def collect_ranks(self, mesh: Mesh) -> list[int]:
        last_stage = mesh.axis_size(PP) - 1
        return [mesh.rank_at(**{self.dp_axis: i, PP: last_stage}) for i in range(mesh.axis_size(self.dp_axis))]

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        mesh = layout.mesh(self.mesh_name)
        chunks, pad, rows = split_rows(args, kwargs, mesh.axis_size(self.dp_axis), self.name)
        per_rank = [chunks[mesh.coord(rank, self.dp_axis)] for rank in range(layout.world_size)]
        return Split(per_rank, pad, rows, concat_ranks=self.collect_ranks(mesh))

    def collect(self, layout: GroupLayout, outputs: list[Any], split: Split) -> Any:
        assert split.concat_ranks is not None
        return concat_outputs([outputs[r] for r in split.concat_ranks], split, self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshDispatch) and (other.mesh_name, other.dp_axis) == (self.mesh_name, self.dp_axis)

    def __hash__(self) -> int:
        return hash((self.mesh_name, self.dp_axis))


class FunctionDispatch(DispatchMode):
    """A custom mode from two functions (see ``register_dispatch_mode``)."""

    def __init__(
        self,
        name: str,
        split: Callable[[GroupLayout, tuple[Any, ...], dict[str, Any]], list[RankCall]],
        collect: Callable[[GroupLayout, list[Any]], Any],
    ) -> None:
        self.name = name
        self._split = split
        self._collect = collect

    def split(self, layout: GroupLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        per_rank = self._split(layout, args, kwargs)
        if len(per_rank) != layout.world_size:
            raise ValueError(
                f"dispatch mode {self.name!r} returned {len(per_rank)} calls for {layout.world_size} ranks"
            )
        return Split(list(per_rank))

    def collect(self, layout: GroupLayout, outputs: list[Any], split: Split) -> Any:
        return self._collect(layout, outputs)


class Dispatch:
    """The built-in transfer protocols."""

    ONE_TO_ALL: DispatchMode = OneToAll()
    ALL_TO_ALL: DispatchMode = AllToAll()
    DP_COMPUTE: DispatchMode = DPCompute()
    MESH = MeshDispatch


_BUILTIN: dict[str, DispatchMode] = {m.name: m for m in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE)}
_REGISTRY: dict[str, DispatchMode] = dict(_BUILTIN)


def register_dispatch_mode(
    mode: DispatchMode | str,
    split: Callable[[GroupLayout, tuple[Any, ...], dict[str, Any]], list[RankCall]] | None = None,
    collect: Callable[[GroupLayout, list[Any]], Any] | None = None,
) -> DispatchMode:
    """Make a custom mode usable as ``@register(dispatch=<mode or its name>)``.

    Pass a ``DispatchMode`` instance, or a name with ``split(layout, args, kwargs)`` returning
    one ``(args, kwargs)`` per rank and ``collect(layout, outputs)`` merging the outputs.
    """
    if isinstance(mode, str):
        if split is None or collect is None:
            raise TypeError("register_dispatch_mode(name, split, collect) needs both functions")
        mode = FunctionDispatch(mode, split, collect)
    if mode.name in _BUILTIN:
        raise ValueError(f"{mode.name!r} is a built-in dispatch mode; pick another name")
    _REGISTRY[mode.name] = mode
    return mode


def resolve_dispatch_mode(mode: DispatchMode | str) -> DispatchMode:
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, str) and mode in _REGISTRY:
        return _REGISTRY[mode]
    known = ", ".join(sorted(_REGISTRY)) + ", Dispatch.MESH(name)"
    raise ValueError(f"unknown dispatch mode {mode!r}; known modes: {known}")


# ------------------------------------------------------------------ row splitting
def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(f"#{i}", value) for i, value in enumerate(args)] + list(kwargs.items())


def _whole(value: Any) -> Any:
    """A future sent whole to every rank: rows stay remote when they can, else it is materialised."""
    if isinstance(value, DataBatchFuture):
        remote = value.row_parts(1)
        return remote[0] if remote else value.get()
    return value


_AMBIGUOUS = (torch.Tensor, np.ndarray, list, tuple)


def split_rows(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int, mode: str) -> tuple[list[RankCall], int, int]:
    """Split every DataBatch (or future) argument into ``parts`` row chunks; broadcast scalars.

    Returns the per-part calls, the padding rows added, and the padded row count.
    """
    named = _named(args, kwargs)
    for key, value in named:
        if isinstance(value, _AMBIGUOUS):
            raise TypeError(
                f"{mode} splits DataBatch arguments by rows; argument {key!r} is a {type(value).__name__}. "
                "Wrap it in a DataBatch to split it, or register the method with Dispatch.ONE_TO_ALL "
                "to send it whole to every rank"
            )
    if not any(isinstance(v, (DataBatch, DataBatchFuture)) for _, v in named):
        kinds = ", ".join(f"{k}: {type(v).__name__}" for k, v in named) or "no arguments"
        raise TypeError(f"{mode} needs at least one DataBatch argument to split across ranks; got {kinds}")

    batches = {k: v for k, v in named if isinstance(v, DataBatch)}
    needs_pad = any(len(b) % parts for b in batches.values())
    remote: dict[str, list[RemoteRows]] = {}
    for key, value in named:
        if isinstance(value, DataBatchFuture):
            rows = None if needs_pad else value.row_parts(parts)
            if rows is None:
                batches[key] = _materialise(value, key, mode)
            else:
                remote[key] = rows

    sizes = {k: len(b) for k, b in batches.items()}
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k} has {n} rows" for k, n in sizes.items())
        raise ValueError(f"{mode}: DataBatch arguments must have the same number of rows; {listing}")
    if any(n == 0 for n in sizes.values()):
        raise ValueError(f"{mode}: cannot split an empty DataBatch across {parts} ranks")

    pad, rows, chunks = 0, 0, {}
    for key, batch in batches.items():
        padded, pad = batch.pad_to_multiple(parts)
        rows = len(padded)
        chunks[key] = padded.chunk(parts)
    chunks.update(remote)

    calls = []
    for i in range(parts):
        part_args = tuple(chunks[k][i] if k in chunks else v for k, v in named[: len(args)])
        part_kwargs = {k: chunks[k][i] if k in chunks else v for k, v in kwargs.items()}
        calls.append((part_args, part_kwargs))
    return calls, pad, rows


def _materialise(future: DataBatchFuture, key: str, mode: str) -> DataBatch:
    value = future.get()
    if not isinstance(value, DataBatch):
        raise TypeError(f"{mode}: argument {key!r} is a future of a {type(value).__name__}, expected a DataBatch")
    return value


def concat_outputs(outputs: Sequence[Any], split: Split, mode: str) -> Any:
    """Concat DataBatch outputs in order and drop the padding rows; other outputs come back as a list."""
    if not outputs or not all(isinstance(o, DataBatch) for o in outputs):
        return None if all(o is None for o in outputs) else list(outputs)
    merged = DataBatch.concat(list(outputs))
    if not split.pad:
        return merged
    per_input_row, rem = divmod(len(merged), split.rows)
    if rem:
        raise ValueError(
            f"{mode}: cannot drop {split.pad} padding rows: the ranks returned {len(merged)} rows for "
            f"{split.rows} padded input rows (not a whole multiple); pass a batch divisible by the ranks"
        )
    return merged.unpad(split.pad * per_input_row)
