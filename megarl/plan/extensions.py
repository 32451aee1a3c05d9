"""The user's own functions a config names by import path (package.module:function), and the
agent rollout's user code (tool and interaction files, loops, a tool-call parser): found and
checked before anything starts, so a typo costs seconds, not a cluster allocation.

The registries do the lookup (megarl/algos/registry.py); this module only says which config
field uses which registry. The import runs in the preflight's child process with the user's
other code (megarl/plan/preflight.py), never in the driver.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megarl.config.section_base import IMPORT_PATH
from megarl.config.sections import MegaRLConfig

# config field -> (module, registry) that resolves its names
REGISTRIES = {
    "algorithm.estimator": ("megarl.algos.advantages", "ADVANTAGE_ESTIMATORS"),
    "algorithm.policy_loss": ("megarl.algos.losses", "POLICY_LOSSES"),
    "rollout.generate_function": ("megarl.rollout.generate", "GENERATE_FUNCTIONS"),
    "rollout.agent.tool_parser": ("megarl.rollout.agents.tool_calls", "PARSERS"),
}
AGENT_FILES = ("rollout.agent.tools_file", "rollout.agent.interactions_file")


def named_functions(cfg: MegaRLConfig) -> list[tuple[str, str]]:
    """``(field, value)`` for every field that names the user's code: import paths, and with the
    default generate function the agent rollout's files and loops."""
    values = {"algorithm.estimator": cfg.algorithm.estimator, "algorithm.policy_loss": cfg.algorithm.policy_loss,
              "rollout.generate_function": cfg.rollout.generate_function}  # fmt: skip
    if cfg.rollout.generate_function == "default":
        agent = cfg.rollout.agent
        values |= {"rollout.agent.tool_parser": agent.tool_parser, "rollout.agent.tools_file": agent.tools_file or "",
                   "rollout.agent.interactions_file": agent.interactions_file or ""}  # fmt: skip
        values |= {f"rollout.agent.loops.{name}": path for name, path in agent.loops.items()}
    return [(field, name) for field, name in values.items() if IMPORT_PATH.match(name) or (field in AGENT_FILES and name)]


def import_problem(field: str, name: str, building: Callable[[str], None] | None = None) -> str | None:
    """Why ``name`` cannot serve as ``field`` (cannot be imported, is missing or not callable; a
    tool or interaction file that does not load), or None. ``building``: told which class of a
    tool or interaction file is built next."""
    from megarl.algos.registry import UnknownNameError

    if field in AGENT_FILES or field.startswith("rollout.agent.loops."):
        return _agent_problem(field, name, building)
    module, attr = REGISTRIES[field]
    try:
        getattr(importlib.import_module(module), attr).get(name)
    except UnknownNameError as err:
        return str(err)
    return None


def _agent_problem(field: str, value: str, building: Callable[[str], None] | None) -> str | None:
    from megarl.algos.registry import UnknownNameError
    from megarl.rollout.agents.driver import loop_class
    from megarl.rollout.agents.interactions import InteractionFileError, load_interactions
    from megarl.rollout.agents.tools import ToolFileError, load_tools

    try:
        if field == "rollout.agent.tools_file":
            load_tools(value, building)
        elif field == "rollout.agent.interactions_file":
            load_interactions(value, building=building)
        else:
            loop_class(value)
    except (ToolFileError, InteractionFileError, UnknownNameError, TypeError) as err:
        return str(err)
    return None
