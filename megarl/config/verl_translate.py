"""A verl run (megarl/config/verl_script.py) -> megarl's config values and the table that accounts for each key.

Every key the run gives becomes a row: the megarl keys and values it set, or why it has none.
verl's defaults apply to the keys not given (no ``algorithm.adv_estimator`` is GAE with a
critic, no ``rollout.n`` is one sample per prompt); a default gets a row of its own when its
meaning differs from megarl's default. Torch-free, like every config module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import yaml

from megarl.config.loading import ConfigError
from megarl.config.sections import MegaRLConfig
from megarl.config.verl_keys import RULES, VERL_DEFAULTS, Rule, exact_rule, rule_for
from megarl.config.verl_script import Given, VerlRun, flatten, parse_hydra
from megarl.config.verl_values import NONE, OMIT, Noted, Refused, Unused, Verl


@dataclass
class Row:
    """One line of the table: the verl key as given (or verl's default), what it became."""

    verl: str
    sets: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # a note on the conversion, or why there is no equivalent
    differs: bool = False  # no equivalent, and the run would train differently from verl's (a stop unless accepted)
    group: str = ""  # for a key without equivalent: FSDP-only, vLLM-only, not supported yet, no equivalent; "" for a
    # key given again later or deleted


@dataclass
class Translation:
    given: list[Row]
    defaults: list[Row]
    choices: list[Row]  # megarl's own choices (the command's layout for an FSDP run)
    values: dict[str, Any]  # dotted megarl key -> value
    origins: dict[str, str]  # dotted megarl key -> the verl text that set it, for errors
    megatron: bool
    notes: list[str]

    @property
    def differences(self) -> list[Row]:
        """The rows of keys without equivalent whose absence changes what would be trained."""
        return [r for r in self.given if r.differs]

    def nested(self) -> dict[str, Any]:
        """The values as a megarl config tree."""
        return nest(self.values)


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys -> a config tree (``{"a.b": 1}`` -> ``{"a": {"b": 1}}``)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(last), dict):  # a mapping given whole and by entries
            value = {**node[last], **value}
        node[last] = value
    return out


def translate(run: VerlRun) -> Translation:
    """The megarl values of ``run`` and a row for each verl key given, then for verl's defaults."""
    given = _last_values(run.given)
    megatron = "megatron" in run.config_name or given.get("actor_rollout_ref.actor.strategy") == "megatron" or any(
        ".megatron." in k for k in given)  # fmt: skip
    verl = Verl(given, megatron, VERL_DEFAULTS)
    out = Translation([], [], [], {}, {}, megatron, list(run.notes))
    for key, value in given.items():
        given[key] = _interpolated(key, value, verl, out.notes)
    last = {g.key: i for i, g in enumerate(run.given)}
    for i, item in enumerate(run.given):
        if item.deleted:
            out.given.append(Row(item.text, note=f"Hydra's delete: verl's default applies to {item.key}"))
        elif last[item.key] != i:
            out.given.append(Row(item.text, note="given again later: the later value wins"))
        else:
            try:
                out.given.append(_row(item.text, item.key, given[item.key], verl, out, item.override))
            except Refused as exc:
                raise ConfigError(f"verl key {item.text}: {exc.reason}; change it in the verl run, or give "
                                  f"{item.key}=VALUE after the run") from None  # fmt: skip
    for rule in RULES:
        if rule.default is not None and "*" not in rule.verl and rule.verl not in given:
            row = _default_row(rule, verl, out)
            if row is not None:
                out.defaults.append(row)
    return out


def _last_values(items: list[Given]) -> dict[str, Any]:
    """The keys given: the last value of each; a delete removes it."""
    given: dict[str, Any] = {}
    for item in items:
        if item.deleted:
            given.pop(item.key, None)
        else:
            given[item.key] = item.value
    return given


_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")
_REF = re.compile(r"(oc\.select:)?(\.*[A-Za-z_][\w.]*)(?:,(.*))?", flags=re.S)


def _interpolated(key: str, value: Any, verl: Verl, notes: list[str]) -> Any:
    """Hydra's ``${a.b}``, ``${oc.select:a.b,default}`` and the relative ``${.sibling}`` (a dump of
    verl's config has them) in the value of ``key``, resolved against the keys given, else verl's
    default of the key (the mapping knows it), else the default written (``oc.select``'s null).
    Any other ``${...}`` (a key the mapping does not know, another resolver) stays as written, with
    a note: never a silent guess."""
    if isinstance(value, list):
        return [_interpolated(key, v, verl, notes) for v in value]
    if isinstance(value, dict):
        return {k: _interpolated(key, v, verl, notes) for k, v in value.items()}
    if not isinstance(value, str) or "${" not in value:
        return value

    def resolve(m: re.Match[str]) -> Any:
        ref = _REF.fullmatch(m[1])
        if ref is None:
            return _kept(m[0], key, f"{m[1].partition(':')[0]} is not a resolver megarl reads", notes)
        select, name, default = ref.groups()
        if name.startswith("."):  # relative: .sibling, ..uncle
            parent = key.split(".")[:-1]
            dots = len(name) - len(name.lstrip("."))
            name = ".".join(parent[: len(parent) - dots + 1] + [name.lstrip(".")])
        if name in verl.given and not (isinstance(verl.given[name], str) and "${" in verl.given[name]):
            return verl.given[name]
        if (rule := exact_rule(name)) is not None and rule.default is not None:
            return verl.get(name)
        if default is not None:
            return parse_hydra(default)
        if select:
            return None  # oc.select of a key set nowhere: null
        return _kept(m[0], key, f"{name} is not a key this run gives or whose verl default megarl's map knows", notes)

    whole = _INTERPOLATION.fullmatch(value)
    if whole:
        return resolve(whole)
    return _INTERPOLATION.sub(lambda m: str(resolve(m)), value)


def _kept(written: str, key: str, why: str, notes: list[str]) -> str:
    """An interpolation left as written, with a note (one: a shell variable kept so has its own)."""
    if not any(f"kept as {written}" in note for note in notes):
        notes.append(f"{written} in {key} is not resolved ({why}): kept as {written}; give {key} as an override after the run")
    return written


def _row(text: str, key: str, value: Any, verl: Verl, out: Translation, override: bool = False) -> Row:
    rule = rule_for(key)
    if rule is None and override and key in _megarl_defaults():  # model.arch=qwen2.5-7b after the run
        out.values[key], out.origins[key] = value, text
        return Row(text, {key: value}, note="a megarl key given after the run: taken as it is")
    if rule is None:  # a typo, most often (verl's Hydra refuses a key it does not know): it would be lost
        return Row(text, note="not a verl key megarl's map knows: check its spelling, or translate it by hand "
                   "(`megarl config` lists megarl's keys)", group=NONE, differs=True)  # fmt: skip
    if not rule.megarl:
        try:  # a rule without megarl keys may still explain a value (rollout.expert_parallel_size)
            if rule.convert is not None:
                rule.convert(value, verl)
        except Unused as exc:
            return Row(text, note=exc.reason, group=exc.group, differs=exc.differs)
        return Row(text, note=rule.reason, group=rule.group)
    try:
        values, note = _converted(rule, value, verl, key)
    except Unused as exc:
        return Row(text, note=exc.reason, group=exc.group, differs=exc.differs)
    except (TypeError, ValueError) as exc:
        if value is None:
            return Row(text, note="null: unset in verl; megarl's default applies", group=NONE)
        raise ConfigError(f"verl key {text}: {value!r} is not a value verl takes there ({exc}); fix it in the verl run "
                          "or override it after the run") from None  # fmt: skip
    if value is None and any(v is None for v in values.values()):
        return Row(text, note="null: unset in verl; megarl's default applies", group=NONE)
    for megarl_key, megarl_value in values.items():
        out.values[megarl_key] = megarl_value
        out.origins[megarl_key] = text
    return Row(text, values, note=note)


def _converted(rule: Rule, value: Any, verl: Verl, key: str) -> tuple[dict[str, Any], str]:
    """The megarl values ``key`` sets and the row's note (the rule's reason unless the converter gave one)."""
    result = rule.convert(value, verl) if rule.convert is not None else value
    note = rule.reason
    if isinstance(result, Noted):
        result, note = result.value, result.note
    results = result if len(rule.megarl) > 1 else (result,)
    pairs = zip(rule.megarl_keys(key), results, strict=True)
    return {k: _plain(v) for k, v in pairs if v is not OMIT}, note


def _plain(value: Any) -> Any:
    """YAML-writable: tuples as lists."""
    return list(value) if isinstance(value, tuple) else value


def _default_row(rule: Rule, verl: Verl, out: Translation) -> Row | None:
    """The row of a verl default the run relies on: shown when it means something else than
    megarl's default (or always, for rule.show_default); None when it changes nothing."""
    value = verl.get(rule.verl)
    text = f"{rule.verl}: {_show(value)}"
    try:
        values, note = _converted(rule, value, verl, rule.verl)
    except Unused as exc:
        return None if exc.quiet or not rule.show_default else Row(text, note=exc.reason, group=exc.group)
    values = {k: v for k, v in values.items() if k not in out.values}
    changed = {k: v for k, v in values.items() if _megarl_default(k) != v}
    if not changed and not rule.show_default:
        return None
    for megarl_key, megarl_value in values.items():
        out.values[megarl_key] = megarl_value
        out.origins[megarl_key] = f"{text} (verl's default)"
    return Row(text, values, note=note)


_MISSING = object()


def _megarl_default(key: str) -> Any:
    return _megarl_defaults().get(key, _MISSING)


@cache
def _megarl_defaults() -> dict[str, Any]:
    return flatten(MegaRLConfig.model_validate({"model": {"arch": "tiny-demo"}}).model_dump(mode="json"))


def _show(value: Any) -> str:
    """A value on one line, as YAML's flow style writes it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def table(translation: Translation) -> str:
    """Every row on one line, never wrapped: the verl key as given, then what it became."""
    sections = [("verl keys given", translation.given), ("verl defaults this run relies on", translation.defaults),
                ("megarl's choices", translation.choices)]  # fmt: skip
    width = max((len(r.verl) for _, rows in sections for r in rows), default=0)
    lines: list[str] = []
    for title, rows in sections:
        if not rows:
            continue
        lines.append(f"{title}:")
        for row in rows:
            lines.append(f"  {row.verl.ljust(width)}  {_outcome(row)}")
    return "\n".join(lines)


def _outcome(row: Row) -> str:
    if row.sets:
        sets = ", ".join(f"{k}: {_show(v)}" for k, v in row.sets.items())
        return f"-> {sets}" + (f"  ({row.note})" if row.note else "")
    return f"-- {row.group}: {row.note}" if row.group else f"-- {row.note}"
