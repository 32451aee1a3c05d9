"""Tools an agent loop can call: the tool file, and running one call safely (the base class:
megarl/rollout/agents/tool_base.py).

A tool file is verl's YAML format, so a verl user's file works unchanged::

    tools:
      - class_name: calculator                 # a built-in name, or package.module.Class
        config: {}                             # passed to the class (verl's `type: native` is ignored)
        tool_schema:                           # OpenAI function format; goes to the chat template
          type: function
          function: {name: calc, description: ..., parameters: {type: object, properties: {...}}}

A tool class follows verl's ``BaseTool`` method names: ``create`` (one instance per call, with
``create_kwargs`` from the sample), ``execute`` (``execute_kwargs``), ``release``. Each may be a
plain or an ``async`` method, so a class written for verl needs only its base class changed.

``call_tool`` runs one call in its own daemon thread with a deadline: a tool that raises, hangs
or returns something that is not text becomes an error message to the model; it never ends the
rollout. A hung thread is abandoned (Python cannot kill it): tools that can hang should bound
their own work (the built-in python tool runs in a killed-on-timeout sandbox process).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import megarl.rollout.agents.builtin_tools  # noqa: F401 - registers the built-in classes
from megarl.rollout.agents.errors import AgentError
from megarl.rollout.agents.tool_base import BUILTIN_TOOLS, Tool
from megarl.user_code import (
    ends_process,
    exit_description,
    printed_head,
    source_file,
    start_user_call,
)


class ToolFileError(AgentError):
    """A tool file that cannot be used; the message names the file, the entry and the fix."""


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave back: the text for the model, and whether it failed (and how)."""

    text: str
    error: str | None = None  # None | "error" (raised / bad arguments / garbage) | "timeout"
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def load_tools(path: str | Path, building: Callable[[str], None] | None = None) -> dict[str, Tool]:
    """The tools of a verl-format tool file, by function name. ``building``: told what is built
    next, once its class is imported (the pre-launch check's process names a class whose
    ``__init__`` ends that process, rather than its import)."""
    label = f"tool file {path}"
    entries = read_yaml_list(path, "tools", "tool file", ToolFileError)
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        tool = _tool_from_entry(entry, f"{label}, tools[{i}]", building)
        if tool.name in tools:
            raise ToolFileError(f"{label}, tools[{i}]: a second tool named {tool.name!r}; function names must be unique")
        tools[tool.name] = tool
    return tools


def read_tool_schemas(path: str | Path) -> list[dict[str, Any]]:
    """The tool file's schemas, for the chat template, without building any tool."""
    entries = read_yaml_list(path, "tools", "tool file", ToolFileError)
    return [_schema_of(entry, f"tool file {path}, tools[{i}]") for i, entry in enumerate(entries)]


def _schema_of(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
        raise ToolFileError(f"{where}: needs class_name and tool_schema (got {entry!r})")
    schema = entry["tool_schema"]
    name = (schema.get("function") or {}).get("name") if isinstance(schema, dict) else None
    if not isinstance(name, str) or not name:
        raise ToolFileError(f"{where}: tool_schema.function.name is missing; write the schema in OpenAI function format")
    return schema


def _tool_from_entry(entry: Any, where: str, building: Callable[[str], None] | None = None) -> Tool:
    schema = _schema_of(entry, where)
    cls = _tool_class(str(entry["class_name"]), where)
    if not issubclass(cls, Tool):
        raise ToolFileError(f"{where}: class_name {entry['class_name']!r} is not a megarl.rollout.agents.tool_base.Tool subclass; "
                            "derive it from Tool (a verl tool needs only its base class changed)")
    config = {k: v for k, v in (entry.get("config") or {}).items() if k != "type"}  # verl's type: native
    if building is not None:
        building(f"building {entry['class_name']} ({where})")
    try:
        return cls(config, schema)
    except Exception as exc:  # noqa: BLE001 - the user's class: name it and its error
        raise ToolFileError(f"{where}: {entry['class_name']}({config}) failed: {type(exc).__name__}: {exc}") from exc
    except BaseException as exc:  # sys.exit in __init__: the class named, not "at import" (the user's Ctrl-C passes)
        if not ends_process(exc):
            raise
        raise ToolFileError(f"{where}: {entry['class_name']}({config}) {exit_description(exc)} while it was built; a tool "
                            "must raise an exception for what it cannot do, never end the process") from exc


def _tool_class(name: str, where: str) -> type[Tool]:
    return BUILTIN_TOOLS[name] if name in BUILTIN_TOOLS else import_class(name, where, ToolFileError, BUILTIN_TOOLS)


def import_class(name: str, where: str, error: type[ValueError], builtin: Collection[str] = ()) -> type:
    """The class ``package.module.Class`` (verl's spelling) or ``package.module:Class``."""
    module_name, _, attr = name.replace(":", ".").rpartition(".")
    if not module_name:
        known = f"a built-in name ({', '.join(builtin)}) nor " if builtin else ""
        raise error(f"{where}: class_name {name!r} is not {known}package.module.Class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        fix = "install it or put its folder on PYTHONPATH"
        if name.startswith("verl."):  # a verl tool file as it is: verl's classes are not megarl's
            builtins = f"use a built-in name ({', '.join(builtin)}), or " if builtin else ""
            fix = (f"verl's classes do not run in megarl: {builtins}port the class to megarl's base class "
                   "(docs/agents.md, 'Your own loop, parser, tool or interaction')")  # fmt: skip
        raise error(f"{where}: class_name {name!r} cannot be imported ({exc}); {fix}") from exc
    except Exception as exc:  # the user's module fails while importing
        raise error(f"{where}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(cls, type):
        raise error(f"{where}: class_name {name!r} is not a class")
    return cls


def read_yaml_list(path: str | Path, key: str, what: str, error: type[ValueError]) -> list[Any]:
    """The non-empty list under ``key`` of a YAML file, or ``error`` naming the file and the fix."""
    # The config files' one-line YAML errors (imported here: the agents need no config loading otherwise).
    from megarl.config.loading import not_text_reason, yaml_error_line

    label = f"{what} {path}"
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror}); check the path (a relative path is relative to "
                    "the working directory)") from exc
    except (UnicodeDecodeError, yaml.reader.ReaderError) as exc:
        raise error(f"{label} is not a YAML text file ({not_text_reason(exc)}); save it as UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise error(yaml_error_line(Path(path), exc, what)) from None
    entries = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise error(f"{label}: needs a non-empty list under '{key}:' (verl's format)")
    return entries


def prompt_tools(cfg: Any) -> list[dict[str, Any]]:
    """The tool schemas every prompt's chat template shows (none without rollout.agent.tools_file,
    or with a generate function of the user's); read from the file, no tool is built."""
    path = cfg.rollout.agent.tools_file
    return read_tool_schemas(path) if path and cfg.rollout.generate_function == "default" else []


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The OpenAI function schemas, for the chat template's ``tools=`` argument."""
    return [tool.tool_schema for tool in tools.values()]


def run_method(value: Any) -> Any:
    """The value of a plain or ``async`` method's result."""
    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


async def _awaited(value: Awaitable[Any]) -> Any:
    """``value`` awaited: asyncio.run takes a coroutine only, not any awaitable (a Future, an
    object with ``__await__``)."""
    return await value


def _outcome_of(result: Any) -> ToolOutcome:
    """verl's ``(ToolResponse | str, reward, metrics)`` or plain text -> ToolOutcome."""
    reward, metrics = 0.0, {}
    if isinstance(result, tuple):
        result, reward, metrics = (*result, 0.0, {})[:3]
    text = getattr(result, "text", result)  # verl's ToolResponse has .text
    if not isinstance(text, str):
        return ToolOutcome(f"Error: the tool returned {type(text).__name__}, not text", error="error")
    reward = float(reward or 0.0)
    if not math.isfinite(reward):  # with turn_rewards it would reach the loss as it is
        return ToolOutcome(f"Error: the tool returned the reward {reward}, not a finite number", error="error")
    return ToolOutcome(text, reward=reward, metrics=dict(metrics or {}))


def _call(tool: Tool, arguments: dict[str, Any], kwargs: Mapping[str, Any]) -> ToolOutcome:
    """One instance per call (create -> execute -> release), as verl's agent loop does."""
    from megarl.data.datasets import without_nulls

    # The row's tools_kwargs come from a parquet struct: a null is a key this row did not have
    # (another row had it), so it is left out and the tool's own default applies.
    create_kwargs, execute_kwargs, release_kwargs = (
        without_nulls(dict(kwargs.get(key) or {})) for key in ("create_kwargs", "execute_kwargs", "release_kwargs")
    )
    # verl's agent loop passes them as one create_kwargs argument; tools written for it read that.
    created = run_method(tool.create(**create_kwargs, create_kwargs=create_kwargs))
    instance = created[0] if isinstance(created, tuple) else created  # verl returns (id, response)
    try:
        return _outcome_of(run_method(tool.execute(instance, arguments, **execute_kwargs)))
    finally:
        run_method(tool.release(instance, **release_kwargs))


def start_tool_call(tool: Tool, arguments: dict[str, Any], kwargs: Mapping[str, Any]) -> Future[ToolOutcome]:
    """Run one call in a daemon thread; the future holds its ToolOutcome, or an AgentError when the
    tool tried to end the process (sys.exit: a bug the run stops on, not the model's feedback)."""
    who = f"tool {tool.name!r} ({type(tool).__name__} in {source_file(tool)})"

    def call() -> ToolOutcome:
        try:
            return _call(tool, arguments, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the tool is the model's feedback
            # A ValueError is the tool refusing its input: its message is for the model as it is.
            text = f"Error: {exc}" if isinstance(exc, ValueError) else f"Error: {type(exc).__name__}: {exc}"
            return ToolOutcome(text, error="error")
        except BaseException as exc:  # (this thread gets no signal: the tool's own doing) said at once, not as a timeout
            raise AgentError(f"{who} {exit_description(exc)}; a tool must return text (an 'Error: ...' for the model) "
                             f"or raise, never end the process{printed_head(who)}") from exc

    # its prints go to the user-code log, not the terminal
    return start_user_call(call, who)


def timed_out(tool_name: str, seconds: float) -> ToolOutcome:
    return ToolOutcome(f"Error: the tool {tool_name} did not answer within {seconds:g} s", error="timeout")
