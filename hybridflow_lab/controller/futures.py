"""Futures of non-blocking calls, and the stand-in that lets one group read another's outputs."""

from __future__ import annotations

from typing import Any, Protocol

_UNSET = object()


class PendingCall(Protocol):
    """A submitted group call (``worker_group.PendingCall``): its ranks' results, merged once they finish."""

    label: str

    def finish(self) -> Any: ...
    def done(self) -> bool: ...
    def concat_handles(self) -> list[Any] | None: ...


class RemoteRows:
    """Rows held in another group's results (object refs, or values on the local backend).

    A rank that receives one fetches the parts itself and concatenates them, so the
    controller never materialises the batch.
    """

    __slots__ = ("parts", "source")

    def __init__(self, parts: list[Any], source: str) -> None:
        self.parts = parts
        self.source = source

    def __repr__(self) -> str:
        return f"RemoteRows({len(self.parts)} parts from {self.source})"


class DataBatchFuture:
    """The pending result of a non-blocking registered call (usually a DataBatch).

    Pass it to another group's call to hand over the data worker-to-worker; call ``get()``
    to bring it to the controller.
    """

    def __init__(self, call: PendingCall) -> None:
        self._call = call
        self._value: Any = _UNSET

    def get(self) -> Any:
        """Wait for every rank, merge the outputs with the method's collect rule, and return it."""
        if self._value is _UNSET:
            self._value = self._call.finish()
        return self._value

    result = get

    def done(self) -> bool:
        """Whether every rank has finished (never blocks)."""
        return self._value is not _UNSET or self._call.done()

    def row_parts(self, n: int) -> list[RemoteRows] | None:
        """Split the result into ``n`` row ranges without fetching it, or None when that needs the data.

        Possible when the result is the plain concatenation of the producing ranks' outputs and
        their number is a multiple of ``n``.
        """
        handles = self._call.concat_handles()
        if handles is None or len(handles) % n:
            return None
        per_part = len(handles) // n
        return [RemoteRows(handles[i * per_part : (i + 1) * per_part], self._call.label) for i in range(n)]

    def __repr__(self) -> str:
        return f"DataBatchFuture({self._call.label}, {'done' if self.done() else 'pending'})"
