"""Checks of a run's agent rollouts on the sampled rows of its data files, before Ray starts.

The preflight (megarl/config/preflight.py) calls :func:`row_findings` in the driver: it reads
names only (the data's agent_name and interaction_kwargs, the interaction file's names) and
imports no user code; the tool and interaction classes load in the preflight's child process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.agents.errors import AgentError
from megarl.agents.interactions import (
    InteractionFileError,
    interaction_name,
    read_interaction_names,
)
from megarl.config.sections import AGENT_LOOPS


def row_findings(agent: Any, files: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[str, str, str]]:
    """``(field, message, level)`` for the sampled ``(label, PromptRecords)`` of every data file."""
    loops = (*AGENT_LOOPS, *agent.loops)
    names = _interaction_names(agent.interactions_file)
    out: list[tuple[str, str, str]] = []
    used: set[str] = set()
    for label, records in files:
        problems: dict[str, str] = {}  # the first row of each kind of problem, per file
        for record in records:
            loop = record.agent_name or agent.default_agent
            used.add(loop)
            if loop not in loops:
                problems.setdefault("loop", f"row {record.row}: agent_name {loop!r} is not an agent loop; use "
                                            f"{', '.join(loops)}, or add yours under rollout.agent.loops")  # fmt: skip
            kwargs = record.extra_info.get("interaction_kwargs")
            if isinstance(kwargs, dict) and names is not None and loop != "single_turn":
                try:
                    interaction_name(kwargs, names)
                except AgentError as exc:
                    problems.setdefault("interaction", f"row {record.row}: {exc}")
        out += [(label, message, "error") for message in problems.values()]
    if agent.tools_file and used <= {"single_turn"}:
        out.append(("rollout.agent.default_agent", "every sampled row runs single_turn, so the tools of "
                    f"rollout.agent.tools_file ({agent.tools_file}) are never called; set rollout.agent.default_agent="
                    "tool_agent (verl's datasets often have no agent_name column) or an agent_name column", "warning"))
    return out


def _interaction_names(path: str | None) -> list[str] | None:
    if not path:
        return None
    try:
        return read_interaction_names(path)
    except InteractionFileError:
        return None  # the child process reports the file itself
