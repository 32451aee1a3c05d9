"""Checks of a run's agent rollouts against its data files, before Ray starts.

The preflight (megarl/plan/preflight.py) calls :func:`row_findings` in the driver: it reads
names only (the whole agent_name column of every file, the sampled rows' extra_info, the
interaction file's names) and imports no user code; the tool and interaction classes load in
the preflight's child process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.config.rollout_sections import AGENT_LOOPS, loop_name
from megarl.rollout.agents.errors import AgentError
from megarl.rollout.agents.interactions import (
    InteractionFileError,
    interaction_name,
    read_interaction_names,
)


def row_findings(agent: Any, files: Sequence[tuple[str, str, Sequence[Any]]]) -> list[tuple[str, str, str]]:
    """``(field, message, level)`` for every data file's ``(label, path, sampled PromptRecords)``."""
    loops = (*AGENT_LOOPS, *agent.loops)
    interactions = _interaction_names(agent.interactions_file)
    tools = _tool_names(agent.tools_file)
    out: list[tuple[str, str, str]] = []
    used: set[str] = set()
    for label, path, records in files:
        for row, name in _agent_names(path, agent.default_agent).items():
            used.add(name)
            if name not in loops:
                out.append((label, f"row {row}: agent_name {name!r} is not an agent loop; use {', '.join(loops)} "
                                   "(or verl's single_turn_agent), or add yours under rollout.agent.loops", "error"))  # fmt: skip
        out += _extra_info_findings(label, records, interactions, tools)
    if agent.tools_file and used <= {"single_turn"}:
        out.append(("rollout.agent.default_agent", "every row runs single_turn, so the tools of rollout.agent.tools_file "
                    f"({agent.tools_file}) are never called; set rollout.agent.default_agent=tool_agent (verl's datasets "
                    "often have no agent_name column) or an agent_name column", "warning"))  # fmt: skip
    if not agent.tools_file and "tool_agent" in used:
        out.append(("rollout.agent.tools_file", "is not set but rows run tool_agent: every call they make will be "
                    "answered 'there is no tool'; set it to a tool file (docs/agents.md)", "warning"))  # fmt: skip
    return out


def _agent_names(path: str, default: str) -> dict[int, str]:
    """The first row of each distinct loop name of the file's whole agent_name column (cheap: one column)."""
    import pyarrow.parquet as pq

    try:
        if "agent_name" not in pq.read_schema(path).names:
            return {0: default}
        column = pq.read_table(path, columns=["agent_name"]).column("agent_name").to_pylist()
    except Exception:  # noqa: BLE001 - an unreadable file is the data check's finding
        return {}
    first: dict[str, int] = {}
    for row, name in enumerate(column):
        first.setdefault(loop_name(name, default), row)
    return {row: name for name, row in first.items()}


def _extra_info_findings(label: str, records: Sequence[Any], interactions: list[str] | None,
                         tools: list[str] | None) -> list[tuple[str, str, str]]:  # fmt: skip
    """The first problem of each kind in the sampled rows' interaction_kwargs and tools_kwargs."""
    problems: dict[str, tuple[str, str]] = {}
    for record in records:
        kwargs = record.extra_info.get("interaction_kwargs")
        if isinstance(kwargs, dict) and interactions is not None:
            try:
                interaction_name(kwargs, interactions)
            except AgentError as exc:
                problems.setdefault("interaction", (f"row {record.row}: {exc}", "error"))
        elif isinstance(kwargs, dict) and kwargs.get("name"):
            problems.setdefault("no_file", (f"row {record.row}: extra_info.interaction_kwargs names {kwargs['name']!r} but "
                                            "rollout.agent.interactions_file is not set, so no simulated user answers", "warning"))  # fmt: skip
        unknown = sorted(set(record.extra_info.get("tools_kwargs") or {}) - set(tools or ())) if tools is not None else []
        if unknown:
            problems.setdefault("tools", (f"row {record.row}: extra_info.tools_kwargs names {unknown[0]!r}, which is not a "
                                          f"tool of rollout.agent.tools_file ({', '.join(tools or ())})", "warning"))  # fmt: skip
    return [(label, message, level) for message, level in problems.values()]


def _interaction_names(path: str | None) -> list[str] | None:
    if not path:
        return None
    try:
        return read_interaction_names(path)
    except InteractionFileError:
        return None  # the child process reports the file itself


def _tool_names(path: str | None) -> list[str] | None:
    from megarl.rollout.agents.tools import ToolFileError, read_tool_schemas

    if not path:
        return None
    try:
        return [schema["function"]["name"] for schema in read_tool_schemas(path)]
    except ToolFileError:
        return None  # the child process reports the file itself
