"""How a tool call is written in the policy's text, and how a tool's result is written back without a chat template.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Qwen's and Hermes' chat
  templates (``</tool_call>`` is one token in Qwen's vocabulary);
- ``plain``: ``[name arg1, arg2]``, positional arguments, short enough for the bundled character-level models.

A turn stops at a format's ``stop`` string, so one turn holds at most one finished call; text the format cannot
read is a ``MalformedCall`` (an error observation and a counted metric, never an exception out of the rollout).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class MalformedCall(ValueError):
    """Text that starts a tool call the format cannot read."""


@dataclass(frozen=True)
class ToolCall:
    """A call as the policy wrote it: the tool's ``name`` and its ``arguments`` (by name, or positional)."""

    name: str
    arguments: dict[str, Any] | list[Any]
    text: str


class CallFormat(Protocol):
    name: str
    stop: tuple[str, ...]  # generation stops after these (a finished call)

    def calls(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` ([] for none); ``MalformedCall`` for a call it cannot read."""
        ...

    def result_text(self, result: str) -> str:
        """A tool's result as the text that follows the call, for a model without a chat template."""
        ...

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        """A call of tool ``name`` with ``arguments`` as the policy writes it (``calls`` reads it back)."""
        ...

    def describe(self, schemas: Sequence[dict[str, Any]]) -> str:
        """The tools (OpenAI-format ``schemas``) and how to call them, for a prompt whose chat template does not
        render tools itself."""
        ...


@dataclass(frozen=True)
class HermesFormat:
    name: str = "hermes"
    stop: tuple[str, ...] = ("</tool_call>",)

    def calls(self, text: str) -> list[ToolCall]:
        found = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as exc:
                raise MalformedCall(f"the tool call is not JSON ({exc.msg} at character {exc.pos})") from None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise MalformedCall('a tool call is {"name": <tool>, "arguments": {...}}')
            arguments = call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise MalformedCall("a tool call's arguments are a JSON object")
            found.append(ToolCall(call["name"], arguments, f"<tool_call>{body}</tool_call>"))
        if text.count("<tool_call>") > len(found):
            raise MalformedCall("a <tool_call> is not closed by </tool_call>")
        return found

    def result_text(self, result: str) -> str:
        return f"\n<tool_response>\n{result}\n</tool_response>\n"

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    def describe(self, schemas: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(schema) for schema in schemas)
        return (f"You may call tools. Their signatures, one per line:\n<tools>\n{listed}\n</tools>\nTo call one, "
                'write <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>; '
                "its result follows in <tool_response></tool_response>. Without a call, your reply is the answer.")


@dataclass(frozen=True)
class PlainFormat:
    name: str = "plain"
    stop: tuple[str, ...] = ("]",)

    def calls(self, text: str) -> list[ToolCall]:
        found = []
        for match in re.finditer(r"\[([A-Za-z_]\w*)(?: ([^\[\]]*))?\]", text):
            arguments = [part.strip() for part in match.group(2).split(",")] if match.group(2) else []
            found.append(ToolCall(match.group(1), arguments, match.group(0)))
        if text.count("[") > len(found):
            raise MalformedCall("a call is [name arg1, arg2]: a tool name, a space, then its arguments")
        return found

    def result_text(self, result: str) -> str:
        return f" -> {result}\n"

    def call_text(self, name: str, arguments: dict[str, Any]) -> str:
        return f"[{name} {', '.join(map(str, arguments.values()))}]" if arguments else f"[{name}]"

    def describe(self, schemas: Sequence[dict[str, Any]]) -> str:
        lines = []
        for schema in schemas:
            function = schema["function"]
            names = ", ".join(function["parameters"].get("properties", {}))
            lines.append(f"[{function['name']} {names}]: {function.get('description', '')}")
        return ("You may call tools by writing [name arguments], arguments separated by commas in the order shown; "
                "the result follows after ->. Without a call, your reply is the answer.\n" + "\n".join(lines))


CALL_FORMATS: dict[str, CallFormat] = {"hermes": HermesFormat(), "plain": PlainFormat()}
