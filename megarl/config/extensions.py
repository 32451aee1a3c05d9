"""The user's own functions a config names by import path (package.module:function): found
and checked before anything starts, so a typo costs seconds, not a cluster allocation.

The registries do the lookup (megarl/algos/registry.py); this module only says which config
field uses which registry. The import runs in the preflight's child process with the user's
other code (megarl/config/preflight.py), never in the driver.
"""

from __future__ import annotations

import importlib

from megarl.config.sections import IMPORT_PATH, MegaRLConfig

# config field -> (module, registry) that resolves its names
REGISTRIES = {
    "algorithm.estimator": ("megarl.algos.advantages", "ADVANTAGE_ESTIMATORS"),
    "algorithm.policy_loss": ("megarl.algos.losses", "POLICY_LOSSES"),
    "rollout.generate_function": ("megarl.rollout.collect", "GENERATE_FUNCTIONS"),
}


def named_functions(cfg: MegaRLConfig) -> list[tuple[str, str]]:
    """``(field, package.module:function)`` for every field that names the user's own function."""
    values = {"algorithm.estimator": cfg.algorithm.estimator, "algorithm.policy_loss": cfg.algorithm.policy_loss,
              "rollout.generate_function": cfg.rollout.generate_function}  # fmt: skip
    return [(field, name) for field, name in values.items() if IMPORT_PATH.match(name)]


def import_problem(field: str, name: str) -> str | None:
    """Why ``name`` cannot serve as ``field`` (cannot be imported, is missing or not callable), or None."""
    from megarl.algos.registry import UnknownNameError

    module, attr = REGISTRIES[field]
    try:
        getattr(importlib.import_module(module), attr).get(name)
    except UnknownNameError as err:
        return str(err)
    return None
