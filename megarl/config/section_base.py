"""The base of every config section, and the check of a name that may also be a user's import path.

Torch-free, like every config module (`megarl plan` stays fast).
"""

from __future__ import annotations

import os
import re
import types
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator

# A user's own function (algorithm.estimator / policy_loss, rollout.generate_function).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# The type of every config field that names a file or directory: ``~`` is expanded when a section
# is validated, so a YAML file, an override and a section built in Python agree. The shell leaves
# ``model.path=~/x`` as it is (a dotted key is no variable assignment), and a literal ./~ folder
# made from it invites an `rm -rf ~`. Not for import paths (package.module:function) or addresses.
EXPAND_USER = AfterValidator(os.path.expanduser)
UserPath = Annotated[str, EXPAND_USER]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 for an int or float field: ``rollout.n=true`` would run with n = 1;
        in a list, tuple or mapping of numbers too (``actor.optimizer.betas=[true,0.9]``)."""
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _numbers_only(annotation):
            raise ValueError(f"{str(value).lower()} is a boolean; give a number")
        found = _bool_among_numbers(value, annotation)
        if found is not None:
            where, item = found
            raise ValueError(f"{where} ({str(item).lower()}) is a boolean; give a number")
        return value


def _kinds(annotation: Any) -> list[Any]:
    """The types an annotation allows, None aside (``X | None`` -> [X])."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no boolean (``int``, ``float | None``, ...)."""
    kinds = _kinds(annotation)
    return bool(kinds) and all(k in (int, float) for k in kinds)


def _bool_among_numbers(value: Any, annotation: Any) -> tuple[str, bool] | None:
    """(``item 0`` or ``key NAME``, the boolean) of the first boolean ``value`` holds where
    ``annotation`` wants a number: list[int], tuple[float, float], dict[str, float]; else None."""
    for kind in _kinds(annotation):
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin in (list, tuple) and isinstance(value, (list, tuple)):
            repeated = origin is list or (len(args) == 2 and args[1] is Ellipsis)  # list[X], tuple[X, ...]
            for i, item in enumerate(value):
                slot = args[0] if repeated else args[i] if i < len(args) else None
                if isinstance(item, bool) and slot is not None and _numbers_only(slot):
                    return f"item {i}", item
        elif origin is dict and isinstance(value, dict) and len(args) == 2 and _numbers_only(args[1]):
            for key, item in value.items():
                if isinstance(item, bool):
                    return f"key {key}", item
    return None


def builtin_or_import_path(value: str, builtin: tuple[str, ...], what: str) -> str:
    """``value`` if it names a builtin or looks like package.module:function; else the error
    naming the field ``what``."""
    if value in builtin or IMPORT_PATH.match(value):
        return value
    raise ValueError(f"{what} {value!r} is not one of {', '.join(builtin)}, nor an import path package.module:function")
