"""The base class of every tool an agent loop can call (verl's ``BaseTool`` method names), and
the built-in tools by name (megarl/rollout/agents/builtin_tools.py registers them). Tool files
and calls: megarl/rollout/agents/tools.py."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any

# Built-in tool classes by name (filled by megarl/rollout/agents/builtin_tools.py at import).
BUILTIN_TOOLS: dict[str, type[Tool]] = {}


class Tool:
    """Base of every tool: one schema, a per-call instance, plain or async methods."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        self.name = str(tool_schema["function"]["name"])

    def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start one instance (one call of one trajectory); returns its id."""
        return instance_id or uuid.uuid4().hex

    def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> Any:
        """The answer to the model: text, or verl's ``(response, reward, metrics)``."""
        raise NotImplementedError

    def release(self, instance_id: str, **release_kwargs: Any) -> Awaitable[None] | None:
        """Free what ``create`` made."""


def register_tool(name: str):
    """Class decorator: a built-in tool under ``name`` (the ``class_name`` a tool file uses)."""

    def add(cls: type[Tool]) -> type[Tool]:
        if name in BUILTIN_TOOLS:
            raise ValueError(f"tool {name!r} is already registered ({BUILTIN_TOOLS[name]!r})")
        BUILTIN_TOOLS[name] = cls
        return cls

    return add
