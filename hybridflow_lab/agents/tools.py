"""Tools: plain typed Python functions with a docstring, described to the policy by their JSON schema.

The schema comes from the signature and the docstring's ``Args:`` section through transformers'
``get_json_schema`` (what TRL's ``tools=`` and chat templates' ``tools=`` read), in the OpenAI function format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CONVERTERS: dict[str, Callable[[Any], Any]] = {"integer": int, "number": float, "string": str,
                                               "boolean": lambda v: v if isinstance(v, bool) else str(v) == "true"}


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool's parameters (missing, unknown, or of the wrong type)."""


@dataclass(frozen=True)
class Tool:
    """A function the policy may call, and its OpenAI-format ``schema``."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict[str, dict[str, Any]]:
        """Each parameter's schema, in the signature's order."""
        return self.schema["function"]["parameters"].get("properties", {})

    def arguments(self, values: Mapping[str, Any] | list[Any]) -> dict[str, Any]:
        """``values`` (by name, or in the signature's order) converted to the declared types."""
        names = list(self.parameters)
        if isinstance(values, list):
            if len(values) > len(names):
                raise ToolArgumentError(f"{self.name} takes {len(names)} arguments ({', '.join(names)}), "
                                        f"got {len(values)}")
            values = dict(zip(names, values, strict=False))
        unknown = set(values) - set(names)
        missing = set(self.schema["function"]["parameters"].get("required", [])) - set(values)
        if unknown or missing:
            raise ToolArgumentError(f"{self.name}({', '.join(names)}): "
                                    + "; ".join([*(f"unknown argument {n!r}" for n in sorted(unknown)),
                                                 *(f"missing argument {n!r}" for n in sorted(missing))]))
        converted = {}
        for name, value in values.items():
            kind = self.parameters[name].get("type")
            try:
                converted[name] = CONVERTERS[kind](value) if kind in CONVERTERS else value
            except (TypeError, ValueError):
                raise ToolArgumentError(f"{self.name}: argument {name!r} should be {kind}, got {value!r}") from None
        return converted

    def __call__(self, values: Mapping[str, Any] | list[Any]) -> Any:
        return self.fn(**self.arguments(values))


def as_tool(fn: Callable[..., Any] | Tool) -> Tool:
    """``fn`` as a ``Tool``; a function without type hints or without a docstring describing every argument is
    refused, naming what to add."""
    if isinstance(fn, Tool):
        return fn
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return Tool(fn, get_json_schema(fn))
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {exc}. A tool is a function with a type hint on "
                         "every argument and a docstring: a one-line description, then an 'Args:' section with "
                         "one 'name: description' line per argument") from None


def tool_table(tools: Iterable[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """Tools by name; two tools of one name are refused."""
    table: dict[str, Tool] = {}
    for tool in map(as_tool, tools):
        if tool.name in table:
            raise ValueError(f"two tools are named {tool.name!r}; rename one")
        table[tool.name] = tool
    return table
