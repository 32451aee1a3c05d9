"""`megarl config [SECTION | KEY]`: every config key with its type, default and description, read
from the pydantic models themselves (so the manual cannot drift from the code)."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from megarl.config.loading import ConfigError, _section_type, unknown_key_message
from megarl.config.section_base import EXPAND_USER, UserPath
from megarl.config.sections import MegaRLConfig


def describe(key: str | None = None) -> str:
    """The reference of the whole config, of one dotted section (e.g. ``actor.optimizer``) or of
    one key (e.g. ``actor.optimizer.lr``)."""
    if key and (key.endswith((".yaml", ".yml")) or "/" in key):
        raise ConfigError(f"{key} looks like a config file; `megarl config` takes a section or key (e.g. rollout or "
                          f"rollout.n), and `megarl plan {key}` checks that file")  # fmt: skip
    model: type[BaseModel] = MegaRLConfig
    prefix = ""
    parts = key.split(".") if key else []
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        sub = _section_type(field.annotation) if field else None
        if field is not None and sub is None and i == len(parts) - 1:
            return _key_line(f"{prefix}{part}", field)
        if field is not None and sub is None:
            raise ConfigError(f"{prefix}{part} is a key, not a section; `megarl config {prefix}{part}` describes it")
        if sub is None:
            raise ConfigError(unknown_key_message(model, parts[:i], part))
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
        out.append(_key_line(f"{prefix}{name}", field))
    return out


def _key_line(key: str, field: Any) -> str:
    # pydantic keeps a top-level Annotated's markers on the field, not in its annotation
    kind = "path" if EXPAND_USER in field.metadata else _type(field.annotation)
    return f"{key} = {_default(field)}  ({kind})  {field.description}"


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return repr(field.default)
    if field.default_factory is not None:
        return repr(field.default_factory())
    return "<required>"


def _type(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    if annotation == UserPath:
        return "path"  # a str whose ~ is expanded (docs/configuration.md)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list and typing.get_args(annotation) == (UserPath,):
        return "list[path]"
    text = str(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", str(annotation))
    return re.sub(r"\bmegarl\.config\.\w+\.", "", text.replace("typing.", ""))  # list[DataFile], not its module path


def reference_markdown() -> str:
    """The configuration reference page of the documentation site (docs/ builds it with mkdocs):
    one table per section and subsection, every key with its type, default and description."""
    out = ["# Configuration reference", "",
           "Generated from the config models (`megarl/config/`) when the site is built, so it is the code's own list: "
           "every key, its type, its default and its meaning. `megarl config KEY` prints the same for one key; "
           "[Configuration](../configuration.md) explains how files and overrides combine.", ""]  # fmt: skip
    for name, field in MegaRLConfig.model_fields.items():
        out += _section_markdown(name, field, level=2)
    return "\n".join(out) + "\n"


def _section_markdown(key: str, field: Any, level: int) -> list[str]:
    model = _section_type(field.annotation)
    assert model is not None, key
    optional = " Optional: absent (`None`) unless given." if field.default is None else ""
    out = [f"{'#' * level} `{key}`", "", f"{field.description}{optional}", ""]
    rows = [(name, f) for name, f in model.model_fields.items() if _section_type(f.annotation) is None]
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, f in rows:
            kind = "path" if EXPAND_USER in f.metadata else _type(f.annotation)
            cells = (f"`{key}.{name}`", _cell(kind), _code(_default(f)), _cell(f.description or ""))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for name, f in model.model_fields.items():
        if _section_type(f.annotation) is not None:
            out += _section_markdown(f"{key}.{name}", f, min(level + 1, 6))
    return out


def _code(text: str) -> str:
    return f"`{text}`" if "|" not in text and "`" not in text else _cell(text)


def _cell(text: str) -> str:
    """A table cell: pipes escaped, `<required>` and other angle brackets kept as text, not HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")
