"""DataBatch: the container that moves between the controller and worker groups.

A batch holds named columns that share a leading batch dimension: torch tensors
(``tensors``) and numpy arrays such as prompt text or ground truths (``non_tensors``),
plus free-form ``meta`` (a dict that is not split along the batch).
Every operation returns a new batch and never copies a column it does not change.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

Column = torch.Tensor | np.ndarray
RowIndex = slice | Sequence[int] | np.ndarray | torch.Tensor

SAVE_FORMAT = "hybridflow_lab.DataBatch/1"


class DataBatch:
    """Named tensor and non-tensor columns sharing a leading batch dimension, plus ``meta``."""

    __slots__ = ("_size", "meta", "non_tensors", "summary", "tensors")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        self.summary: Any = None  # what produced this batch, for display (a Lab stage sets it); never shipped
        for key, value in (tensors or {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tensor column {key!r} is a {type(value).__name__}, expected a torch.Tensor")
            if value.dim() == 0:
                raise ValueError(f"tensor column {key!r} is a scalar; columns need a leading batch dimension")
            self.tensors[key] = value
        for key, value in (non_tensors or {}).items():
            self.non_tensors[key] = as_column_array(value, key)
        duplicated = self.tensors.keys() & self.non_tensors.keys()
        if duplicated:
            raise ValueError(f"columns {sorted(duplicated)} are given both as tensors and as non-tensors")
        self._size = self._infer_size(batch_size)

    def _infer_size(self, batch_size: int | None) -> int:
        sizes = {key: len(col) for key, col in self.columns().items()}
        if batch_size is not None:
            sizes = {"batch_size": batch_size, **sizes}
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"{key} has {n}" for key, n in sizes.items())
            raise ValueError(f"DataBatch columns disagree on the batch size: {listing}")
        return next(iter(sizes.values()), 0)

    @classmethod
    def from_dict(cls, columns: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> DataBatch:
        """Build a batch from one mapping: torch tensors become tensor columns, the rest non-tensors."""
        tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in columns.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, others, meta)

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return self._size

    def columns(self) -> dict[str, Column]:
        """All columns, tensors first."""
        return {**self.tensors, **self.non_tensors}

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str | int | RowIndex) -> Any:
        """``batch["name"]`` is a column, ``batch[i]`` a dict for one row, ``batch[rows]`` a batch."""
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.non_tensors:
                return self.non_tensors[key]
            raise KeyError(f"no column {key!r}; the batch has: {', '.join(self.keys()) or 'no columns'}")
        if isinstance(key, (int, np.integer)):
            row = int(key)
            if not -self._size <= row < self._size:
                raise IndexError(f"row {row} is out of range for a batch of {self._size} rows")
            return {name: col[row] for name, col in self.columns().items()}
        return self._take(key)

    def get(self, key: str, default: Any = None) -> Any:
        """The column ``key``, or ``default`` when the batch has no such column."""
        return self.columns().get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        if self.keys() and len(value) != self._size:
            raise ValueError(f"column {key!r} has {len(value)} rows but the batch has {self._size}")
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = as_column_array(value, key)
        self._size = len(value)

    def _take(self, index: RowIndex) -> DataBatch:
        if isinstance(index, slice):
            tensors = {k: v[index] for k, v in self.tensors.items()}
            non_tensors = {k: v[index] for k, v in self.non_tensors.items()}
            return DataBatch(tensors, non_tensors, self.meta, batch_size=len(range(self._size)[index]))
        rows = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if rows.dtype != np.bool_:
            rows = rows.astype(np.int64)
        elif len(rows) != self._size:
            raise IndexError(f"a boolean mask of {len(rows)} entries for a batch of {self._size} rows")
        torch_rows = torch.from_numpy(rows)
        tensors = {k: v[torch_rows.to(v.device)] for k, v in self.tensors.items()}
        non_tensors = {k: v[rows] for k, v in self.non_tensors.items()}
        size = int(rows.sum()) if rows.dtype == np.bool_ else len(rows)
        return DataBatch(tensors, non_tensors, self.meta, batch_size=size)

    @property
    def nbytes(self) -> int:
        """Bytes held by tensor and numeric columns (object columns count their pointers)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + sum(
            a.nbytes for a in self.non_tensors.values()
        )

    # --------------------------------------------------------- column algebra
    def _with(self, tensors: Mapping[str, torch.Tensor], non_tensors: Mapping[str, np.ndarray]) -> DataBatch:
        return DataBatch(tensors, non_tensors, self.meta, batch_size=self._size)

    def select(self, *keys: str) -> DataBatch:
        """A batch with only ``keys`` (and the same meta)."""
        self._require(keys, "select")
        return self._with(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
        )

    def pop(self, *keys: str) -> DataBatch:
        """Remove ``keys`` from this batch and return them as a new batch."""
        popped = self.select(*keys)
        for key in keys:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
        return popped

    def union(self, other: DataBatch) -> DataBatch:
        """Columns and meta of both batches; a column or meta key present in both must be equal."""
        self._require_rows(other, "union")
        for key in set(self.keys()) & set(other.keys()):
            if not columns_equal(self[key], other[key]):
                raise ValueError(f"union: column {key!r} differs between the two batches")
        for key in self.meta.keys() & other.meta.keys():
            if not values_equal(self.meta[key], other.meta[key]):
                raise ValueError(f"union: meta key {key!r} differs between the two batches")
        return self.assign(other)

    def assign(self, other: DataBatch) -> DataBatch:
        """Columns and meta of both batches, ``other``'s where both have one: a stage that rewrites columns."""
        self._require_rows(other, "assign")
        tensors = {k: v for k, v in self.tensors.items() if k not in other.non_tensors} | other.tensors
        non_tensors = {k: v for k, v in self.non_tensors.items() if k not in other.tensors} | other.non_tensors
        return DataBatch(tensors, non_tensors, {**self.meta, **other.meta}, batch_size=self._size)

    def _require_rows(self, other: DataBatch, operation: str) -> None:
        if len(other) != self._size:
            raise ValueError(f"{operation} of batches with {self._size} and {len(other)} rows")

    def _require(self, keys: Iterable[str], operation: str) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            have = ", ".join(self.keys()) or "no columns"
            raise KeyError(f"{operation}: no column(s) {missing}; the batch has: {have}")

    # ------------------------------------------------------------- row algebra
    def chunk(self, n: int) -> list[DataBatch]:
        """Split into ``n`` equal parts; the size must divide (see ``pad_to_multiple``)."""
        if n <= 0:
            raise ValueError(f"chunk(n) needs n >= 1, got {n}")
        if self._size % n:
            raise ValueError(
                f"a batch of {self._size} rows cannot be split into {n} equal chunks; "
                f"use pad_to_multiple({n}) first or pick a batch size divisible by {n}"
            )
        return self.split(self._size // n) if self._size else [self._take(slice(0, 0)) for _ in range(n)]

    def split(self, size: int) -> list[DataBatch]:
        """Consecutive parts of ``size`` rows; the last one may be shorter."""
        if size <= 0:
            raise ValueError(f"split(size) needs size >= 1, got {size}")
        return [self._take(slice(start, start + size)) for start in range(0, self._size, size)]

    @staticmethod
    def concat(batches: Sequence[DataBatch]) -> DataBatch:
        """Stack batches with the same columns row-wise.

        Meta keys with equal values in every part keep that value; a key whose values
        differ becomes a list with one entry per part (None where a part lacks it).
        """
        if not batches:
            raise ValueError("concat needs at least one DataBatch")
        first = batches[0]
        for i, part in enumerate(batches[1:], start=1):
            if not isinstance(part, DataBatch):
                raise TypeError(f"concat: part {i} is a {type(part).__name__}, expected a DataBatch")
            if set(part.tensors) != set(first.tensors) or set(part.non_tensors) != set(first.non_tensors):
                raise ValueError(
                    f"concat: part {i} has columns {sorted(part.keys())} but part 0 has {sorted(first.keys())}"
                )
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        size = sum(len(b) for b in batches)
        return DataBatch(tensors, non_tensors, merge_meta([b.meta for b in batches]), batch_size=size)

    def repeat(self, n: int, interleave: bool = True) -> DataBatch:
        """Each row ``n`` times: ``aabb`` when ``interleave`` else ``abab``."""
        rows = np.arange(self._size)
        return self._take(np.repeat(rows, n) if interleave else np.tile(rows, n))

    def reorder(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> DataBatch:
        """Rows in the order given by ``index`` (a permutation of ``range(len(self))``)."""
        order = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64)
        if sorted(order.tolist()) != list(range(self._size)):
            raise ValueError(f"reorder needs a permutation of range({self._size}), got {order.tolist()[:16]}")
        return self._take(order)

    def pad_to_multiple(self, n: int) -> tuple[DataBatch, int]:
        """Append rows copied cyclically from the start so that ``n`` divides the size.

        Returns the padded batch and the number of rows added (pass it to ``unpad``).
        """
        pad = -self._size % n
        if pad == 0:
            return self, 0
        if self._size == 0:
            raise ValueError("cannot pad an empty batch: there is no row to copy")
        return DataBatch.concat([self, self._take(np.arange(pad) % self._size)]), pad

    def unpad(self, pad: int) -> DataBatch:
        """Drop the last ``pad`` rows (added by ``pad_to_multiple``)."""
        if not 0 <= pad <= self._size:
            raise ValueError(f"cannot drop {pad} padding rows from a batch of {self._size}")
        return self._take(slice(0, self._size - pad)) if pad else self

    def to(self, device: str | torch.device) -> DataBatch:
        """Move tensor columns to ``device``."""
        return self._with({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors)

    def equals(self, other: object) -> bool:
        """Same columns with equal values and equal meta."""
        return (
            isinstance(other, DataBatch)
            and len(other) == self._size
            and set(self.keys()) == set(other.keys())
            and all(columns_equal(self[k], other[k]) for k in self.keys())
            and values_equal(self.meta, other.meta)
        )

    # ----------------------------------------------------------------- display
    def to_pandas(self, max_list_len: int = 8) -> Any:
        """A DataFrame for notebooks: text columns, scalars and short rows; long rows as a shape."""
        import pandas as pd

        frame: dict[str, Any] = {}
        for key, col in self.columns().items():
            frame[key] = column_for_display(col, max_list_len)
        return pd.DataFrame(frame, index=pd.RangeIndex(self._size))

    def _repr_html_(self) -> str:
        header = self.summary._repr_html_() if hasattr(self.summary, "_repr_html_") else ""
        return f"{header}<p>{self._summary()}</p>" + self[:8].to_pandas().to_html(max_cols=20)

    def _summary(self) -> str:
        parts = [f"{k} {str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for k, v in self.tensors.items()]
        parts += [f"{k} {v.dtype}" for k, v in self.non_tensors.items()]
        meta = f"; meta: {', '.join(self.meta)}" if self.meta else ""
        return f"DataBatch({self._size} rows; {', '.join(parts) or 'no columns'}{meta})"

    def __repr__(self) -> str:
        return self._summary()

    # --------------------------------------------------------- serialisation
    def __reduce__(self) -> tuple[Any, ...]:
        # Tensors travel as numpy arrays so that Ray's pickle-5 path ships them out of band.
        payload = {k: tensor_to_wire(v) for k, v in self.tensors.items()}
        return (_rebuild_batch, (payload, self.non_tensors, self.meta, self._size))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the batch to ``path`` in a format that loads with ``torch.load(weights_only=True)``."""
        path = Path(path)
        non_tensors = {}
        for key, array in self.non_tensors.items():
            values = array.tolist()
            require_plain(values, f"non-tensor column {key!r}")
            non_tensors[key] = {"dtype": array.dtype.str if array.dtype != object else "object", "values": values}
        require_plain(self.meta, "meta")
        record = {"format": SAVE_FORMAT, "size": self._size, "tensors": self.tensors,
                  "non_tensors": non_tensors, "meta": self.meta}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(record, tmp)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DataBatch:
        """Read a batch written by ``save``; a file holding other Python objects is refused, never unpickled."""
        try:
            record = torch.load(Path(path), weights_only=True)
        except pickle.UnpicklingError as error:
            raise ValueError(f"{path} is not a saved DataBatch: it holds Python objects that could run code when "
                             "unpickled, so it is refused") from error
        if not isinstance(record, dict) or record.get("format") != SAVE_FORMAT:
            raise ValueError(f"{path} is not a saved DataBatch ({SAVE_FORMAT})")
        non_tensors = {}
        for key, column in record["non_tensors"].items():
            non_tensors[key] = as_column_array(column["values"], key, dtype=column["dtype"])
        return cls(record["tensors"], non_tensors, record["meta"], batch_size=record["size"])


# ------------------------------------------------------------------ helpers
def as_column_array(value: Any, key: str, dtype: str | None = None) -> np.ndarray:
    """A numpy array for a non-tensor column.

    Lists of numbers become numeric arrays; anything else becomes a 1-D object array with
    one Python object per row (so rows that are lists stay lists).
    """
    if isinstance(value, np.ndarray):
        array = value if dtype is None else value.astype(dtype)
    elif isinstance(value, (list, tuple)):
        array = _list_to_array(value, dtype)
    else:
        raise TypeError(f"non-tensor column {key!r} is a {type(value).__name__}; expected a list or numpy array")
    if array.ndim == 0:
        raise ValueError(f"non-tensor column {key!r} is a scalar; columns need a leading batch dimension")
    return array


def _list_to_array(values: Sequence[Any], dtype: str | None) -> np.ndarray:
    if dtype is None and values and all(isinstance(v, (bool, int, float)) for v in values):
        return np.asarray(values)
    if dtype not in (None, "object"):
        return np.asarray(values, dtype=np.dtype(dtype))
    array = np.empty(len(values), dtype=object)
    for i, item in enumerate(values):
        array[i] = item
    return array


def columns_equal(a: Column, b: Column) -> bool:
    """Equal type, shape and values (NaNs in the same places count as equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(values_equal(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True))
    return False


def values_equal(a: Any, b: Any) -> bool:
    """Equality that also works for tensors, arrays and nested containers."""
    if isinstance(a, (torch.Tensor, np.ndarray)) or isinstance(b, (torch.Tensor, np.ndarray)):
        return type(a) is type(b) and columns_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:  # objects whose __eq__ is not a plain truth value
        return a is b


def merge_meta(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Keys equal in every part keep their value; differing keys become one entry per part."""
    merged: dict[str, Any] = {}
    keys = dict.fromkeys(k for meta in metas for k in meta)
    for key in keys:
        values = [meta.get(key) for meta in metas]
        same = all(key in meta for meta in metas) and all(values_equal(values[0], v) for v in values[1:])
        merged[key] = values[0] if same else values
    return merged


def column_for_display(col: Column, max_list_len: int) -> list[Any]:
    """One display value per row: scalars, short lists, or ``dtype[shape]`` for long rows."""
    if isinstance(col, torch.Tensor):
        if col.dim() == 1:
            return col.tolist()
        if col.dim() == 2 and col.shape[1] <= max_list_len:
            return col.tolist()
        label = f"{str(col.dtype).removeprefix('torch.')}{list(col.shape[1:])}"
        return [label] * len(col)
    return list(col)


_PLAIN_SCALARS = (type(None), bool, int, float, str)


def require_plain(value: Any, where: str) -> None:
    """Raise unless ``value`` holds only types that ``torch.load(weights_only=True)`` accepts."""
    if isinstance(value, (*_PLAIN_SCALARS, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            require_plain(item, where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, _PLAIN_SCALARS):
                raise TypeError(f"{where}: dict key {key!r} is a {type(key).__name__}; save needs plain keys")
            require_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} holds a {type(value).__name__}; DataBatch.save stores only None, bool, int, float, str, "
        "lists, dicts and tensors"
    )


def tensor_to_wire(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy view of a CPU copy of ``tensor`` plus its torch dtype name."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        return tensor.numpy(), dtype
    except TypeError:  # dtypes numpy lacks (bfloat16, float8): ship the raw bytes
        return tensor.view(torch.uint8).numpy(), dtype


def tensor_from_wire(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of ``tensor_to_wire``; copies read-only buffers so that workers may write in place."""
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    target = getattr(torch, dtype)
    return tensor if tensor.dtype == target else tensor.view(target)


def _rebuild_batch(
    payload: dict[str, tuple[np.ndarray, str]], non_tensors: dict[str, np.ndarray], meta: dict[str, Any], size: int
) -> DataBatch:
    tensors = {k: tensor_from_wire(array, dtype) for k, (array, dtype) in payload.items()}
    writable = {k: v if v.flags.writeable else v.copy() for k, v in non_tensors.items()}
    return DataBatch(tensors, writable, meta, batch_size=size)


def payload_nbytes(value: Any) -> int:
    """Bytes of tensor data in a call's arguments or result (batches, tensors, arrays, containers)."""
    if isinstance(value, DataBatch):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(payload_nbytes(v) for v in value.values())
    return 0
