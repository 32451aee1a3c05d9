"""`megarl config [SECTION]`: every config key with its type, default and description, read
from the pydantic models themselves (so the manual cannot drift from the code)."""

from __future__ import annotations

import re
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from megarl.config.loading import ConfigError, _section_type
from megarl.config.sections import MegaRLConfig


def describe(section: str | None = None) -> str:
    """The reference of the whole config, or of one dotted section (e.g. ``actor.optimizer``)."""
    model: type[BaseModel] = MegaRLConfig
    prefix = ""
    for part in section.split(".") if section else []:
        field = model.model_fields.get(part)
        sub = _section_type(field.annotation) if field else None
        if sub is None:
            valid = [k for k, f in model.model_fields.items() if _section_type(f.annotation)]
            raise ConfigError(f"{prefix}{part} is not a config section; sections here: {', '.join(valid)}")
        model, prefix = sub, f"{prefix}{part}."
    return "\n".join(_lines(model, prefix))


def _lines(model: type[BaseModel], prefix: str) -> list[str]:
    out: list[str] = []
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            optional = " (optional section, default None)" if field.default is None else ""
            out.append(f"{prefix}{name}:{optional}  # {field.description}")
            out += _lines(sub, f"{prefix}{name}.")
            continue
        out.append(f"{prefix}{name} = {_default(field)}  ({_type(field.annotation)})  {field.description}")
    return out


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return repr(field.default)
    if field.default_factory is not None:
        return repr(field.default_factory())
    return "<required>"


def _type(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    text = str(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", str(annotation))
    return re.sub(r"\bmegarl\.config\.\w+\.", "", text.replace("typing.", ""))  # list[DataFile], not its module path
