"""The bundled tools a run names in ``agent.tools``: the calculator and the Python tool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow_lab.agents.python_tool import python_tool
from hybridflow_lab.agents.tools import Tool
from hybridflow_lab.tasks.calculator import calc

BUNDLED_TOOLS: dict[str, Callable[[], Callable[..., Any] | Tool]] = {"calc": lambda: calc, "python": python_tool}


def bundled_tools(names: tuple[str, ...]) -> list[Callable[..., Any] | Tool]:
    """The bundled tools ``names``; an unknown name is refused, naming the known ones."""
    unknown = [name for name in names if name not in BUNDLED_TOOLS]
    if unknown:
        raise ValueError(f"no bundled tool named {', '.join(map(repr, unknown))}; bundled tools: "
                         f"{', '.join(BUNDLED_TOOLS)}")
    return [BUNDLED_TOOLS[name]() for name in names]
