"""Finding the tool calls in a model's turn: parsers by name (``rollout.agent.tool_parser``).

A parser is a function ``parse(text) -> ParsedCalls``: the turn's calls in the order written,
each a well-formed ``ToolCall`` or, for a malformed one, the error message the loop answers it
with (as a failed call). Answers go back in the same order. The
built-in ``hermes`` parser reads the Hermes / Qwen format the chat templates of Qwen2.5 and
Qwen3 describe to the model::

    <tool_call>
    {"name": "calc", "arguments": {"expression": "2+3"}}
    </tool_call>

Your own parser is named by import path (``package.module:function``, docs/agents.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megarl.algos.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    items: list[ToolCall | str] = field(default_factory=list)  # in the turn's order; str: a malformed call's error

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [item for item in self.items if isinstance(item, str)]

    @property
    def attempted(self) -> int:
        return len(self.items)


ToolCallParser = Callable[[str], ParsedCalls]
PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


@PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, in order."""
    items: list[ToolCall | str] = []
    for match in _HERMES.finditer(text):
        if not match.group(0).endswith(HERMES_CLOSE):
            items.append(f"Error: the tool call is not closed with {HERMES_CLOSE}")
        else:
            items.append(_call_from_json(match.group(1).strip()))
    return ParsedCalls(items)


def _call_from_json(body: str) -> ToolCall | str:
    """A ToolCall from ``{"name": str, "arguments": dict | JSON string}``, else an error message."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"Error: the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return 'Error: a tool call needs {"name": "<tool>", "arguments": {...}}'
    arguments = value.get("arguments")
    if arguments is None:  # absent or null: a call without arguments
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"Error: the arguments of {value['name']} are not a JSON object"
    if not isinstance(arguments, dict):
        return f"Error: the arguments of {value['name']} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(value["name"], arguments)
