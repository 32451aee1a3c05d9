"""The base of every config section, and the check of a name that may also be a user's import path.

Torch-free, like every config module (`megarl plan` stays fast).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# A user's own function (algorithm.estimator / policy_loss, rollout.generate_function).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 for an int or float field: ``rollout.n=true`` would run with n = 1."""
        if isinstance(value, bool) and info.field_name is not None:
            if _numbers_only(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"{str(value).lower()} is a boolean; give a number")
        return value


def _numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no boolean (``int``, ``float | None``, ...)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    else:
        kinds = [annotation]
    return bool(kinds) and all(k in (int, float) for k in kinds)


def builtin_or_import_path(value: str, builtin: tuple[str, ...], what: str) -> str:
    """``value`` if it names a builtin or looks like package.module:function; else the error
    naming the field ``what``."""
    if value in builtin or IMPORT_PATH.match(value):
        return value
    raise ValueError(f"{what} {value!r} is not one of {', '.join(builtin)}, nor an import path package.module:function")
