"""``@register``: a worker method declares how the controller calls it across ranks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from hybridflow_lab.controller.dispatch import Dispatch, DispatchMode, resolve_dispatch_mode

F = TypeVar("F", bound=Callable[..., Any])
REGISTER_ATTR = "__hybridflow_register__"


class Execute(StrEnum):
    """Which ranks run a call."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """How one registered method is dispatched, executed and collected."""

    name: str
    dispatch: DispatchMode
    execute: Execute
    blocking: bool
    doc: str | None
    signature: inspect.Signature


def register(
    dispatch: DispatchMode | str = Dispatch.ONE_TO_ALL,
    execute: Execute | str = Execute.ALL,
    blocking: bool = True,
) -> Callable[[F], F]:
    """Expose a worker method to the controller.

    ``dispatch`` says how arguments are split across ranks and results merged
    (``Dispatch.ONE_TO_ALL``, ``ALL_TO_ALL``, ``DP_COMPUTE``, ``MESH(name)`` or a
    registered custom mode); ``execute`` which ranks run it; ``blocking=False`` makes the
    controller-side call return a ``DataBatchFuture``.
    """
    mode = resolve_dispatch_mode(dispatch)
    how = Execute(execute)

    def mark(method: F) -> F:
        signature = inspect.signature(method)
        params = list(signature.parameters.values())[1:]  # drop self
        spec = MethodSpec(method.__name__, mode, how, blocking, method.__doc__, signature.replace(parameters=params))
        setattr(method, REGISTER_ATTR, spec)
        return method

    return mark


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """The registered methods of a worker class, base classes included."""
    found: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            spec = getattr(value, REGISTER_ATTR, None)
            if isinstance(spec, MethodSpec):
                found[name] = spec
            else:  # an override without @register is a plain method again
                found.pop(name, None)
    return found
