"""Reading a verl run as users keep it: a run script (verl's examples/*.sh), a Hydra YAML, or both.

`megarl config --from-verl run.sh` needs the verl keys the run sets, each with its value and the
text it was given as (the table shows it so). A verl script is shell: `set -x`, `export` lines,
variables set in it or left to the environment (``${VAR:-default}`` too), other commands before
the ``python3 -m verl.trainer.main_ppo`` line, quoted Hydra lists, a trailing ``$@``, and
redirections or a pipeline after it (``2>&1 | tee log.txt``: left out, with a note). This module
reads that much shell (quotes, escapes, line continuations, ``$VAR`` expansion) without running
anything; Hydra values are read as Hydra reads them (``1e-6`` is a number, ``[a,b]`` a list).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from megarl.config.loading import ConfigError, not_text_reason, yaml_error_line


@dataclass(frozen=True)
class Given:
    """One verl key the run sets: ``text`` as the user wrote it (for the table), ``value`` as Hydra reads it."""

    key: str
    value: Any
    text: str
    deleted: bool = False  # Hydra's ~key
    override: bool = False  # given after the run on megarl's command line (there a megarl key is taken too)


@dataclass
class VerlRun:
    """What a verl run sets: its keys in order, the config it starts from, and what could not be read."""

    given: list[Given] = field(default_factory=list)
    config_name: str = "ppo_trainer"
    config_path: str | None = None  # --config-path: a directory that may hold the user's own config-name YAML
    notes: list[str] = field(default_factory=list)  # unset variables, skipped words: printed above the table
    exported: dict[str, str] = field(default_factory=dict)  # the script's `export`ed variables: verl's environment


# The module lines that start a verl trainer (verl's main_ppo and the recipes' main_*).
_ENTRY = re.compile(r"^(verl\.trainer\.main_\w+|recipe\.[\w.]*main_\w+|verl\.[\w.]*main\w*)$")
_VAR = re.compile(r"\$(?:(?P<plain>[A-Za-z_]\w*)|(?P<special>[@*#?$!0-9]))")


def read_verl(path: str | Path, overrides: list[str] | tuple[str, ...] = (), env: Mapping[str, str] | None = None) -> VerlRun:
    """The keys of a verl script or YAML at ``path``, then ``overrides`` (key=value words as the
    script's command line would take them; they win). ``env``: the variables a script reads that it
    does not set (the caller's environment by default), as the shell would see them."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"verl run {file} does not exist (or is not a file); give a verl run script (.sh) or a verl YAML config")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"verl run {file} is not a text file ({not_text_reason(exc)}); give a .sh script or a YAML config") from None
    run = VerlRun()
    if file.suffix in (".yaml", ".yml"):
        _read_yaml_into(run, file, text)
    else:
        _read_script_into(run, file, text, dict(os.environ if env is None else env))
    for word in overrides:
        _add_word(run, word, word, f"override {word!r}", override=True)
    seen = dict(os.environ if env is None else env)
    if file.suffix not in (".yaml", ".yml"):
        seen |= run.exported
    run.given = [replace(g, value=_oc_env(g.value, g.key, seen, run.notes)) for g in run.given]
    run.notes = list(dict.fromkeys(run.notes))  # a variable used twice: one note
    return run


_OC_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_]\w*)(?:,([^}]*))?\}")


def _oc_env(value: Any, key: str, env: Mapping[str, str], notes: list[str]) -> Any:
    """OmegaConf's ``${oc.env:NAME}`` (``${oc.env:NAME,default}``) read from the environment verl
    would run in, as the shell's ``$NAME`` is; set nowhere (and no default), it stays as written,
    with a note."""
    if isinstance(value, list):
        return [_oc_env(v, key, env, notes) for v in value]
    if isinstance(value, dict):
        return {k: _oc_env(v, key, env, notes) for k, v in value.items()}
    if not isinstance(value, str) or "${oc.env:" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        if m[1] in env:
            return env[m[1]]
        if m[2] is not None:
            return str(parse_hydra(m[2]))
        notes.append(f"{m[0]} in {key}: ${m[1]} is not set in the environment: kept as {m[0]}; set it, or give {key} "
                     "as an override after the run")  # fmt: skip
        return m[0]

    whole = _OC_ENV.fullmatch(value)
    if whole and (whole[1] in env or whole[2] is not None):
        return parse_hydra(env.get(whole[1], whole[2]))
    return _OC_ENV.sub(one, value)


def _read_yaml_into(run: VerlRun, file: Path, text: str) -> None:
    """A verl YAML: a Hydra config (its ``defaults`` list names the config it extends) or a dump."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_line(file, exc, what="verl config")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"verl config {file}: the top level must be a mapping of verl's groups (data, actor_rollout_ref, ...)")
    for item in data.pop("defaults", None) or []:
        name = item if isinstance(item, str) else next(iter(item.values()), "") if isinstance(item, dict) else ""
        if isinstance(name, str) and "megatron" in name:
            run.config_name = "ppo_megatron_trainer"
    for key, value in flatten(data).items():
        run.given.append(Given(key, _hydra_value(value), f"{key}: {_show(value)}"))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty mapping stays a value (``engine_kwargs.vllm: {}``)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


def _read_script_into(run: VerlRun, file: Path, text: str, env: dict[str, str]) -> None:
    """Walk the script's commands: assignments set variables, the verl command gives the keys."""
    variables: dict[str, str] = {}
    found: _Command | None = None
    previous: _Command | None = None
    for command in _commands(text, variables, env, run.notes):
        if _command_into(run, file, command, variables):
            found = command
            if command.redirections:
                run.notes.append(f"line {command.last_line}: {' '.join(command.redirections)} after the verl command: "
                                 "shell redirections, not verl keys: left out")  # fmt: skip
        elif previous is not None and previous is found and found.end in ("|", "|&"):
            piped = " ".join(raw for raw, _ in command.words)
            run.notes.append(f"line {command.first_line}: the verl command's output piped to `{piped}`: left out")
        elif found is not None:
            _dropped_keys(run, found, command)
        previous = command
    if found is None:
        raise ConfigError(f"verl run {file}: no `python3 -m verl.trainer.main_ppo` (or recipe main_*) command found; "
                          "give the script that starts verl, or a verl YAML config")  # fmt: skip
    own = Path(file.parent, run.config_path or "", f"{run.config_name}.yaml") if run.config_path else None
    if own is not None and own.is_file():  # the user's config: its keys come before the command line's
        words, run.given = run.given, []
        _read_yaml_into(run, own, own.read_text(encoding="utf-8"))
        run.given += words
        run.notes.append(f"read {own} (--config-path, --config-name) before the command line's keys")


_KEY_WORD = re.compile(r"[+~]{0,2}[A-Za-z_]\w*\.[\w.]+=")  # a Hydra override of a dotted key


def _dropped_keys(run: VerlRun, found: _Command, command: _Command) -> None:
    """A command after the verl command that is made of verl overrides: the verl command ended
    before them (a ``\\`` followed by spaces, or a comment line inside the continuation, ends it; bash
    too, and verl never sees them). Named in a note: they are not translated."""
    keys = [raw for raw, word in command.words if _KEY_WORD.match(word)]
    if keys:
        run.notes.append(f"line {command.first_line}: {len(keys)} key=value word(s) after the verl command ended (line "
                         f"{found.last_line}) are not part of it and were left out ({keys[0]}, ...): a `\\` followed by "
                         "spaces, or a comment line inside the continuation, ends the command (in bash too); join "
                         "them to it, or give them after the run")  # fmt: skip


def _command_into(run: VerlRun, file: Path, command: _Command, variables: dict[str, str]) -> bool:
    """One command's words (raw, expanded): an assignment, `export`, or the verl command."""
    words = [w for _, w in command.words]
    pairs = command.words
    if not words:
        return False
    exported = words[0] == "export"
    if words[0] in ("export", "declare", "local", "readonly"):
        pairs, words = pairs[1:], words[1:]
    entry = next((i for i, w in enumerate(words[:-1]) if w == "-m" and _ENTRY.match(words[i + 1])), None)
    if entry is None:
        for word in words:  # VAR=value lines (and `export VAR=value`)
            name, eq, value = word.partition("=")
            if eq and re.fullmatch(r"[A-Za-z_]\w*", name):
                variables[name] = value
                if exported:
                    run.exported[name] = value
            else:
                break
        return False
    rest = pairs[entry + 2 :]
    i = 0
    while i < len(rest):
        raw, word = rest[i]
        if word in ("--config-path", "--config-name", "-cp", "-cn") and i + 1 < len(rest):
            _hydra_flag(run, file, word, rest[i + 1][1])
            i += 2
            continue
        if word.startswith(("--config-path=", "--config-name=", "-cp=", "-cn=")):
            flag, _, value = word.partition("=")
            _hydra_flag(run, file, flag, value)
        elif word:
            _add_word(run, word, raw, f"{file}: word {raw!r}")
        i += 1
    return True


def _hydra_flag(run: VerlRun, file: Path, flag: str, value: str) -> None:
    """--config-name picks verl's config (ppo_megatron_trainer: the Megatron defaults); a
    config-path's own YAML of that name is read when it is there."""
    if flag in ("--config-name", "-cn"):
        name = value.removesuffix(".yaml")
        run.config_name = "ppo_megatron_trainer" if "megatron" in name else name
        run.notes.append(f"--config-name={value}: verl's {run.config_name} defaults")
        return
    run.config_path = value


def _add_word(run: VerlRun, word: str, raw: str, where: str, override: bool = False) -> None:
    """A Hydra override word: key=value, +key=value, ++key=value, or ~key (a delete)."""
    if word.startswith("~"):
        run.given.append(Given(word[1:].partition("=")[0], None, raw, deleted=True))
        return
    key, eq, value = word.lstrip("+").partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
        raise ConfigError(f"{where}: not a verl override key=value (e.g. data.train_batch_size=256); remove it or fix its quoting")
    run.given.append(Given(key, parse_hydra(value), raw, override=override))


def parse_hydra(text: str) -> Any:
    """A Hydra override's value: numbers as Hydra reads them (``1e-6``), lists and dicts in its
    flow syntax (``['a.parquet', 'b.parquet']``, ``[console,wandb]``), null, true/True, else text."""
    stripped = text.strip()
    if re.fullmatch(r"[-+]?\d+", stripped):
        return int(stripped)
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", stripped, flags=re.I):
        return float(stripped)
    if stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if stripped.lower() in ("null", "none", "~"):
        return None
    if stripped.startswith(("[", "{")):
        masked, held = _held_interpolations(stripped)
        try:
            return _restored(_hydra_value(yaml.safe_load(masked)), held)
        except yaml.YAMLError:
            return stripped
    return stripped[1:-1] if len(stripped) > 1 and stripped[0] == stripped[-1] and stripped[0] in "'\"" else stripped


_HELD = "MEGARL_HELD_{}_"  # a plain YAML word standing for one ``${...}`` while a flow list or dict is read


def _held_interpolations(text: str) -> tuple[str, list[str]]:
    """``text`` with each ``${...}`` (braces balanced: ``${oc.select:a,${b}}``) replaced by a plain
    word: YAML's flow syntax would read its braces as a mapping (``[${DATA}/a.parquet,${DATA}/b.parquet]``,
    a variable left unset, or ``[${oc.env:HOME}/a.parquet]``). Returns the text and the interpolations."""
    held: list[str] = []
    out, i = [], 0
    while (start := text.find("${", i)) >= 0:
        depth, end = 0, start + 1
        while end < len(text):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
            end += 1
        if depth:  # unbalanced: left to YAML as it is
            break
        out.append(text[i:start] + _HELD.format(len(held)))
        held.append(text[start : end + 1])
        i = end + 1
    return "".join(out) + text[i:], held


def _restored(value: Any, held: list[str]) -> Any:
    """The interpolations ``_held_interpolations`` took out, back in every string of ``value``."""
    if isinstance(value, list):
        return [_restored(v, held) for v in value]
    if isinstance(value, dict):
        return {_restored(k, held): _restored(v, held) for k, v in value.items()}
    if isinstance(value, str) and "MEGARL_HELD_" in value:
        for n in reversed(range(len(held))):  # 10 before 1
            value = value.replace(_HELD.format(n), held[n])
    return value


def _hydra_value(value: Any) -> Any:
    """Items of a YAML-read list or dict read as Hydra would (``'1e-6'`` is a number)."""
    if isinstance(value, list):
        return [_hydra_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _hydra_value(v) for k, v in value.items()}
    return parse_hydra(value) if isinstance(value, str) and not value.startswith(("[", "{")) else value


@dataclass
class _Command:
    """One shell command: its words (raw text, expanded), the redirections left out, the operator
    that ended it (``|``, ``&&``, ``;``, a newline; "" at the end) and the lines it spans."""

    words: list[tuple[str, str]] = field(default_factory=list)
    redirections: list[str] = field(default_factory=list)
    end: str = ""
    first_line: int = 1
    last_line: int = 1


_OPERATORS = ("&&", "||", "|&", ";;", "|", "&", ";")
_REDIRECTION = re.compile(r"&>>?|[<>]&|>>|>\||<<<?|<>|[<>]")


def _commands(text: str, variables: dict[str, str], env: dict[str, str], notes: list[str]) -> Iterator[_Command]:
    """The commands of ``text`` one at a time (so that each sees the variables the ones before it
    set), as the shell reads them: quotes removed, $VAR expanded except in single quotes, backslash-
    newline continuations joined (not in a comment: a comment ends at its line), # comments dropped,
    redirections (``2>&1``, ``> log``, ``&> log``) left out and recorded."""
    command, raw, word, quote, started, line = _Command(), "", "", "", False, 1
    i = 0

    def finish_word() -> None:
        nonlocal raw, word, started
        if started:
            command.words.append((raw, word))
        raw, word, started = "", "", False

    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1 : i + 2] == "\n" and quote != "'":  # a continuation
            i, line = i + 2, line + 1
            continue
        if c == "\n":
            line += 1
        if quote == "'":
            quote, raw, word = ("" if c == "'" else quote), raw + c, word + ("" if c == "'" else c)
        elif c == "\\" and i + 1 < len(text) and (not quote or text[i + 1] in '"$`\\'):
            raw, word, i = raw + text[i : i + 2], word + text[i + 1], i + 1
        elif c == "$":
            value, length = _expand(text[i:], variables, env, notes)
            raw, word, started, i = raw + text[i : i + length], word + value, True, i + length - 1
        elif c in "'\"" and (not quote or c == quote):
            quote, raw, started = ("" if quote else c), raw + c, True
        elif quote:
            raw, word = raw + c, word + c
        elif c == "#" and not started:
            while i + 1 < len(text) and text[i + 1] != "\n":
                i += 1
        elif (m := _REDIRECTION.match(text, i)) is not None:
            fd = raw if started and raw.isdigit() else ""
            if not fd:
                finish_word()
            raw, word, started = "", "", False
            j = m.end()
            while j < len(text) and text[j] in " \t":
                j += 1
            k = j
            while k < len(text) and not text[k].isspace() and text[k] not in ";&|<>":
                k += 1
            command.redirections.append(f"{fd}{m[0]}{text[j:k]}")
            i = k
            continue
        elif c.isspace() or c in ";&|":
            finish_word()
            if c == "\n" or c in ";&|":
                op = next(o for o in _OPERATORS if text.startswith(o, i)) if c != "\n" else "\n"
                i += len(op) if c != "\n" else 1
                if command.words or command.redirections:
                    command.end, command.last_line = op, line - (c == "\n")
                    yield command
                command = _Command(first_line=line)
                continue
        else:
            raw, word, started = raw + c, word + c, True
        i += 1
    finish_word()
    if command.words or command.redirections:
        command.last_line = line
        yield command


def _expand(text: str, variables: dict[str, str], env: dict[str, str], notes: list[str]) -> tuple[str, int]:
    """The value of the ``$...`` at the start of ``text`` and the characters it spans. ``$@``
    (the script's own arguments) is empty: give them as overrides after the script. A variable set
    nowhere stays as written, with a note naming it."""
    if text.startswith("$("):
        end = _closing(text, "(", ")")
        notes.append(f"{text[:end]}: command substitution is not run; give the value as an override after the script")
        return text[:end], end
    if text.startswith("${"):
        return _expand_braced(text, variables, env, notes)
    m = _VAR.match(text)
    if m is None:
        return "$", 1
    if m["special"]:
        return "", m.end()
    return _lookup(m["plain"], m.group(0), variables, env, notes), m.end()


def _closing(text: str, opening: str, closing: str) -> int:
    """The end of the bracketed run ``text`` starts with (past its matching ``closing``; the
    whole text when it is not closed)."""
    depth = 0
    for j, c in enumerate(text):
        depth += c == opening
        depth -= c == closing
        if depth == 0 and c == closing:
            return j + 1
    return len(text)


def _lookup(name: str, written: str, variables: dict[str, str], env: dict[str, str], notes: list[str]) -> str:
    value = variables.get(name, env.get(name))
    if value is None:
        notes.append(f"${name} is not set in the script or the environment: kept as {written}; set it, or give the "
                     "key it feeds as an override after the script")  # fmt: skip
        return written
    return value


def _expand_braced(text: str, variables: dict[str, str], env: dict[str, str], notes: list[str]) -> tuple[str, int]:
    """``${NAME}``, ``${NAME:-word}`` (``-``, ``=``, ``+`` too), the word itself expanded and
    unquoted (``${MODEL_PATH:-"${HOME}/models/x"}``)."""
    end = _closing(text, "{", "}")
    inner = text[2 : end - 1]
    m = re.match(r"([A-Za-z_]\w*|[@*#?$!0-9])(:?[-=+?])?(.*)$", inner, flags=re.S)
    if m is None:
        return text[:end], end
    name, op, word = m.groups()
    if op is None and word:  # not the shell's: Hydra's ${a.b}, ${oc.env:NAME} (resolved with the keys)
        return text[:end], end
    if not re.match(r"[A-Za-z_]", name):
        return "", end
    if op is None:
        return _lookup(name, text[:end], variables, env, notes), end
    value = variables.get(name, env.get(name))
    unset = value is None or (op.startswith(":") and not value)
    if op.endswith("+"):
        return (_word(word, variables, env, notes) if not unset else ""), end
    if unset and op.endswith(("-", "=")):
        expanded = _word(word, variables, env, notes)
        if op.endswith("="):
            variables[name] = expanded
        return expanded, end
    return (value or ""), end


def _word(word: str, variables: dict[str, str], env: dict[str, str], notes: list[str]) -> str:
    """A default word of ``${NAME:-word}`` as the shell reads it: quotes removed, $VAR expanded."""
    return " ".join(w for command in _commands(word, variables, env, notes) for _, w in command.words)
