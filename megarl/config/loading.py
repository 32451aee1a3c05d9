"""Reading a config: YAML file + dotted command-line overrides -> a validated MegaRLConfig.

`megarl launch cfg.yaml rollout.n=8 actor.optimizer.lr=2e-6`: each override's value is parsed
as a YAML scalar (or flow list/dict: `data.val_files=[a.parquet,b.parquet]`). Unknown keys, in
the file or in an override, are refused with the closest valid key suggested, and so is a key
the file gives twice (plain YAML keeps the last one without a word). Errors are
ConfigError with one line per problem: the field path, the value, and what to do; a problem
with a value an override set names that override, not the YAML file.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from megarl.config.sections import MegaRLConfig
from megarl.config.verl_keys import exact_rule, is_verl_key, megarl_name, no_equivalent_reason


class ConfigError(ValueError):
    """A user configuration mistake; the message names the field and the fix."""


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> MegaRLConfig:
    """Read ``path`` (YAML), apply ``key.path=value`` overrides, validate. Every mistake is named
    at once: an override that cannot apply (an unknown key, bad YAML) is named and left out, and
    the validation names the other values that are wrong (not what the left-out one would have set)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    applied, problems, left_out = _apply_overrides(raw, overrides)
    try:
        cfg = validate_config(raw, source=str(path) if path else "<overrides>", overrides=applied, left_out=left_out)
    except ConfigError as exc:
        problems += [str(exc)] if str(exc) else []  # (empty: every error was a left-out override's)
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def load_section(overrides: list[str] | tuple[str, ...], section: str) -> Any:
    """One section of a config without a config file (e.g. ``reward`` for `megarl evaluate`):
    its defaults with ``section.key=value`` overrides; every mistake named at once, as load_config does."""
    raw: dict[str, Any] = {}
    applied, problems, left_out = _apply_overrides(raw, overrides, section)
    model = _section_type(MegaRLConfig.model_fields[section].annotation)
    assert model is not None, section
    try:
        result = model.model_validate(raw.get(section, {}))
    except ValidationError as exc:
        errors: list[ErrorDetails] = [{**err, "loc": (section, *err["loc"])} for err in exc.errors()]
        lines = [_describe_error(err) for err in errors if not _near_left_out(err["loc"], left_out)]
        origin = next(iter(applied.values()), "<defaults>")
        if lines:
            problems.append(f"override {origin}: invalid configuration\n" + "\n".join(f"  - {ln}" for ln in lines))
    if problems:
        raise ConfigError("\n".join(problems))
    return result


def _apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...],
                     section: str | None = None) -> tuple[dict[str, str], list[str], list[tuple[str, ...]]]:  # fmt: skip
    """Set each override in ``raw``: (key -> the override as typed, to name it in errors; the
    problems of those that cannot apply; their keys, split). ``section``: the only one allowed."""
    applied: dict[str, str] = {}
    problems: list[str] = []
    left_out: list[tuple[str, ...]] = []
    for item in overrides:
        try:
            key, value = parse_override(item)
            if section is not None and key.split(".")[0] != section:
                raise ConfigError(f"override {item!r}: without a config file only {section}.* settings apply here; "
                                  f"give the config file to set {key}")  # fmt: skip
            _set_dotted(raw, key, value, merge=_check_key_path(key))
        except ConfigError as exc:
            problems.append(str(exc))
            left_out.append(tuple(item.split("=", 1)[0].strip().split(".")))
            continue
        applied[key] = item
    return applied, problems, left_out


def _near_left_out(loc: tuple[Any, ...], left_out: Sequence[tuple[str, ...]]) -> bool:
    """Whether a validation error at ``loc`` is about what a left-out override would have set: the
    key itself, a section above it (``model`` missing after ``model.arh=...``) or a value under it."""
    path = tuple(str(p) for p in loc if not isinstance(p, int))
    return any(path[: len(key)] == key or key[: len(path)] == path for key in left_out)


def validate_config(raw: dict[str, Any], source: str = "<config>", overrides: dict[str, str] | None = None,
                    left_out: Sequence[tuple[str, ...]] = ()) -> MegaRLConfig:  # fmt: skip
    """Validate ``raw``; errors name ``source``, or the override (``key=value``) that set the value.
    ``left_out``: the keys of overrides that could not apply (their errors are said already)."""
    try:
        return MegaRLConfig.model_validate(raw)
    except ValidationError as exc:
        by_source: dict[str, list[str]] = {}
        for err in exc.errors():
            if _near_left_out(err["loc"], left_out):
                continue
            origin = _override_of(err["loc"], overrides or {})
            by_source.setdefault(f"override {origin}" if origin else source, []).append(_describe_error(err))
        parts = [f"{where}: invalid configuration\n" + "\n".join(f"  - {ln}" for ln in lines) for where, lines in by_source.items()]
        raise ConfigError("\n".join(parts)) from None


def _override_of(loc: tuple[Any, ...], overrides: dict[str, str]) -> str | None:
    """The override that set the value at ``loc`` (the key itself or a section above it)."""
    path = [str(p) for p in loc]
    for depth in range(len(path), 0, -1):
        item = overrides.get(".".join(path[:depth]))
        if item is not None:
            return item
    return None


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; the value is a YAML scalar / flow collection."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value (e.g. rollout.n=8)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value {text!r} is not valid YAML ({exc.problem})") from None
    comment = _dropped_comment(text)
    if comment is not None:  # `run #1` would become `run`: another run's folder, silently
        raise ConfigError(f"override {item!r}: YAML reads {comment!r} as a comment and the value as {value!r}; quote the "
                          f"value to keep it whole: {key}=\"'{text}'\" (the outer quotes for the shell)")  # fmt: skip
    glued = _glued_entry(value)
    if glued is not None:
        fixed = re.sub(r"(?<=[{,\s])([^\s{},:]+):(?=\S)", r"\1: ", text)
        raise ConfigError(f"override {item!r}: YAML reads {glued!r} as one key with no value (a mapping needs a space "
                          f"after each colon); write it as '{key}={fixed}', quoted for the shell")  # fmt: skip
    return key, value


def _dropped_comment(text: str) -> str | None:
    """The `` #...`` comment YAML drops after an override's value, or None."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    rest = text[node.end_mark.index :].strip() if node is not None else text.strip()
    return rest if rest.startswith("#") else None


def _glued_entry(value: Any) -> str | None:
    """A key of a flow mapping in ``value`` written ``name:value`` without a space (YAML reads
    ``{path:/x}`` as ``{"path:/x": None}``; the shell splits ``{path: /x}`` unless quoted), else None."""
    if isinstance(value, list):
        return next((g for v in value if (g := _glued_entry(v)) is not None), None)
    if not isinstance(value, dict):
        return None
    for k, v in value.items():
        if v is None and isinstance(k, str) and re.match(r"[^\s:]+:\S", k):  # (a data source may hold a /)
            return k
        if (g := _glued_entry(v)) is not None:
            return g
    return None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, lines: tuple[int, int], column: int):
        super().__init__(f"key {key} appears twice")
        self.key, self.lines, self.column = key, lines, column


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML lets a repeated key silently replace the first (a second ``rollout:`` block drops the
    whole first one), so a config mapping with a key given twice is refused instead."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            # merge keys (``<<: *base``) are YAML's way to override on purpose, not a duplicate
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, (seen[key], line), key_node.start_mark.column)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except (UnicodeDecodeError, yaml.reader.ReaderError) as exc:  # a parquet, a checkpoint, an image...
        raise ConfigError(f"config file {path} is not a YAML text file ({not_text_reason(exc)}); give a YAML config "
                          "(see configs/)") from None  # fmt: skip
    except _DuplicateKey as exc:
        key = _key_path(path.read_text(encoding="utf-8"), exc.lines[1], exc.column) or exc.key
        raise ConfigError(f"config file {path}: key {key} is given twice (lines {exc.lines[0]} and {exc.lines[1]}) "
                          "and YAML would keep only the last; merge them into one") from None  # fmt: skip
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_line(path, exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


# Fixes for PyYAML problems whose cause is nearly always the same (matched on the problem and its context).
_SYNTAX_FIXES = (
    ("'\\t' that cannot start any token", "indent with spaces: YAML does not allow tabs"),
    ("mapping values are not allowed here", "check this line's indentation, or quote a value that contains ': '"),
    ("expected ',' or '}'", "close the { with }"),
    ("expected ',' or ']'", "close the [ with ]"),
    ("found undefined alias", "define the anchor (&name) before the alias (*name)"),
    ("could not find expected ':'", "a key needs ': ' after it; check this line and the one above"),
    ("while scanning a quoted scalar", "close the quote"),
)


def yaml_error_line(path: Path, exc: yaml.YAMLError, what: str = "config file") -> str:
    """``file:line:col: problem (context); fix``: PyYAML's own message spans several lines (each
    mark with the source line and a caret), which the one-line error report would split. ``what``
    names the file (a config file, a tool file, ...) when the error has no position."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:  # not a marked error: its text, on one line
        return f"{what} {path} is not valid YAML: {' '.join(str(exc).split())}"
    line = f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        if at is not None and (at.line, at.column) != (mark.line, mark.column):  # started elsewhere
            line += f" ({context} started at {at.line + 1}:{at.column + 1})"
        else:
            line += f" ({context})"
    fix = next((fix for text, fix in _SYNTAX_FIXES if text in line), None)
    return f"{line}; {fix}" if fix else line


def _key_path(text: str, line: int, column: int) -> str | None:
    """The dotted path (``rollout.sampling.top_p``) of the mapping key at ``line`` (1-based), ``column``."""

    def walk(node: yaml.Node, path: list[str]) -> str | None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                here = [*path, str(key_node.value)]
                mark = key_node.start_mark
                if isinstance(key_node, yaml.ScalarNode) and (mark.line + 1, mark.column) == (line, column):
                    return ".".join(here)
                found = walk(value, here)
                if found:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found = walk(item, [*path, str(i)])
                if found:
                    return found
        return None

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    return walk(root, []) if root is not None else None


def not_text_reason(exc: UnicodeDecodeError | yaml.reader.ReaderError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"byte {exc.object[exc.start]:#04x} at offset {exc.start} is not UTF-8"
    return f"character U+{exc.character:04X} at offset {exc.position} is not allowed in YAML"


def _set_dotted(raw: dict[str, Any], key: str, value: Any, merge: bool = False) -> None:
    """``raw[a][b][c] = value`` for ``key`` a.b.c; ``merge``: a mapping given for a section is
    merged into what the file set there (``rollout.sampling={temperature: 0.7}`` keeps the
    file's max_new_tokens), as Hydra does."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"override {key}: {where} is a value ({child!r}), not a section")
        node = child
    if merge and isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        value = _merged(node[parts[-1]], value)
    node[parts[-1]] = value


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_key_path(key: str) -> bool:
    """Refuse an override whose key does not exist, suggesting the closest one. The last part
    may be an entry of a mapping field (``reward.functions.my_source=gsm8k``). Returns whether
    the key names a section."""
    model: type[BaseModel] | None = MegaRLConfig
    walked: list[str] = []
    parts = key.split(".")
    annotation: Any = None
    for i, part in enumerate(parts):
        if model is None:
            if typing.get_origin(annotation) is not dict:
                raise ConfigError(f"override {key}: {'.'.join(walked)} is a value, not a section")
            if i < len(parts) - 1:
                raise ConfigError(f"override {key}: {'.'.join(walked)} is a mapping; set one entry, "
                                  f"{'.'.join(walked)}.NAME=VALUE")  # fmt: skip
            return False  # one entry of the mapping, merged into the file's
        fields = model.model_fields
        if part not in fields:
            raise ConfigError(unknown_key_message(model, walked, part, full=key))
        walked.append(part)
        annotation = fields[part].annotation
        model = _section_type(annotation)
    return model is not None


def unknown_key_message(model: type[BaseModel], walked: list[str], name: str, full: str | None = None) -> str:
    """What to say of a key ``name`` that the section ``model`` (at dotted path ``walked``) lacks:
    verl's name for a megarl key (``full``: the whole key given) with megarl's, the key one
    section down when it lives there (rollout.temperature: verl's flat names), else the closest
    name and the keys there are. For overrides, YAML files and `megarl config`."""
    path = ".".join([*walked, name])
    verl = verl_hint(full or path)
    if verl is not None:
        return verl
    deeper = _nested_key(model, name)
    if deeper:
        return f"unknown key {path}; did you mean {'.'.join([*walked, deeper])}?"
    return _unknown_key_message(path, name, list(model.model_fields))


def verl_hint(key: str) -> str | None:
    """``actor_rollout_ref.actor.optim.lr is verl's name; megarl's is actor.optimizer.lr`` for a
    key of verl's (its own rule; a pattern only below a group megarl lacks, so that a misspelt
    megarl key is not taken for verl's), else None."""
    rule = exact_rule(key)
    top = key.split(".")[0]
    if rule is None and (top in MegaRLConfig.model_fields or not is_verl_key(key)):
        return None
    translate = "`megarl config --from-verl RUN --out FILE` translates a whole verl run"
    megarl = megarl_name(key)
    if megarl is not None:
        return f"{key} is verl's name; megarl's is {megarl} ({translate}, units included)"
    reason = no_equivalent_reason(key)
    if reason is not None:
        return f"{key} is verl's name; megarl has no equivalent ({reason})"
    return f"{key} is a group of verl's config; {translate}"


def _nested_key(model: type[BaseModel], name: str) -> str | None:
    """``sampling.temperature`` when ``name`` is a key of one of ``model``'s sections (the first found)."""
    for field_name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None and name in sub.model_fields:
            return f"{field_name}.{name}"
    return None


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation like ``X``, ``X | None``; else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _unknown_key_message(path: str, name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"did you mean {path.rsplit('.', 1)[0] + '.' if '.' in path else ''}{close[0]}?" if close else ""
    return f"unknown key {path}; {hint + ' ' if hint else ''}valid keys here: {', '.join(valid)}"


def _describe_error(err: ErrorDetails) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        parent = _model_at(err["loc"][:-1])
        if parent is None:
            return _unknown_key_message(loc, str(err["loc"][-1]), [])
        return unknown_key_message(parent, [str(p) for p in err["loc"][:-1]], str(err["loc"][-1]))
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    shown = "" if isinstance(value, dict) or msg.endswith("is a boolean; give a number") else f" (got {value!r})"
    return f"{loc or 'config'}: {msg}{shown}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = MegaRLConfig
    for part in loc:
        if isinstance(part, int):  # an index into a list of sections (data.train_files.0)
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _section_type(model.model_fields[part].annotation)
    return model


def config_to_yaml(cfg: MegaRLConfig) -> str:
    """The fully-resolved config (defaults included), for logs and checkpoints."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
