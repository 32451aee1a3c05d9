"""The base of every config section, and the check of a name that may also be a user's import path.

Torch-free, like every config module (`megarl plan` stays fast).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

# A user's own function (algorithm.estimator / policy_loss, rollout.generate_function).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def builtin_or_import_path(value: str, builtin: tuple[str, ...], what: str) -> str:
    """``value`` if it names a builtin or looks like package.module:function; else the error
    naming the field ``what``."""
    if value in builtin or IMPORT_PATH.match(value):
        return value
    raise ValueError(f"{what} {value!r} is not one of {', '.join(builtin)}, nor an import path package.module:function")
