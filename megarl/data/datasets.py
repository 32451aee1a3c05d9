"""Parquet prompt files in the verl schema: reading and checking them row by row.

The schema (one row per prompt), as verl and most RL recipes write it:

    data_source   str                                   which dataset / reward function
    prompt        str | list[{role: str, content: str}] raw text or chat messages (role: system,
                                                        user, assistant or tool; content: text;
                                                        other keys, e.g. tool_calls, go to the
                                                        chat template)
    ability       str (optional)                        e.g. "math"
    reward_model  {ground_truth: any, style: str}       what the reward function checks against
                                                        (other fields reach it as
                                                        extra_info["reward_model"])
    extra_info    dict (optional)                       free per-row metadata, passed to rewards
    agent_name    str (optional)                        the row's agent loop (docs/agents.md)

Every malformed row or missing column is a :class:`DataError` naming the file (with the config
field it came from), the row and the column. This module only reads and checks; rendering
prompts into token ids is megarl/data/prompts.py, drawing batches is megarl/data/sampler.py.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A prompt as stored: raw text, or chat messages [{"role": ..., "content": ..., other keys}].
Prompt = str | list[dict[str, Any]]
# The roles a message may have: what megarl's own code writes (the agent loops append assistant
# and tool turns) and its chat-template paths are tested with. A template silently drops a role
# it does not know (Qwen2.5's does), so any other role is refused rather than trained without.
ROLES = ("system", "user", "assistant", "tool")

SCHEMA_HELP = (
    "expected the verl schema: data_source (str), prompt (str or list of {role, content}), "
    "ability (str, optional), reward_model ({ground_truth, style}), extra_info (dict, optional), "
    "agent_name (str, optional); "
    "`megarl data convert` writes it from JSONL/CSV"
)


class DataError(ValueError):
    """A user's data file is missing, unreadable or malformed (the message says where and how to fix)."""


@dataclass(frozen=True)
class PromptRecord:
    """One checked row of a prompt file."""

    data_source: str
    prompt: Prompt
    ground_truth: Any
    row: int  # row number in its file (0-based), for error messages and PromptBatch.index
    ability: str = ""
    style: str = "rule"
    extra_info: dict[str, Any] = field(default_factory=dict)
    agent_name: str = ""  # "" = rollout.agent.default_agent


def file_label(field_name: str, path: str | Path) -> str:
    """How errors name a file: ``data.train_files[0] (gsm8k.parquet)``."""
    return f"{field_name} ({Path(path).name})" if field_name else str(path)


def read_prompt_file(path: str | Path, *, label: str = "", prompt_key: str = "prompt",
                     source_key: str = "data_source") -> list[PromptRecord]:
    """Read and check every row of a verl-schema parquet file.

    ``label`` names the file in errors (e.g. ``data.train_files[0] (gsm8k.parquet)``);
    ``prompt_key`` is the column holding the prompt (``data.prompt_key``), ``source_key`` the one
    read as each row's data_source (``data.reward_fn_key``).
    """
    import pyarrow.parquet as pq

    label = label or str(path)
    _check_exists(label, path)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt / non-parquet file
        raise _unreadable(label, path, exc) from exc
    _check_columns(label, table.column_names, prompt_key, source_key)
    return _check_table(label, table, prompt_key, range(table.num_rows), source_key)


SAMPLE_ROWS = 1000


def check_prompt_file(path: str | Path, *, label: str = "", prompt_key: str = "prompt",
                      sample_rows: int = SAMPLE_ROWS, source_key: str = "data_source") -> list[PromptRecord]:
    """The pre-launch check of a prompt file, cheap on any size: the parquet footer (readable,
    columns, at least one row), then at most ``sample_rows`` rows checked as training checks them.

    The rows are the first ones of row groups spread over the file (streamed: a 1 GB file costs a
    fraction of a second); returns them. Raises DataError with the same messages as training.
    """
    import pyarrow.parquet as pq

    label = label or str(path)
    _check_exists(label, path)
    try:
        # Unbuffered column chunks are read page by page: a row group's head costs its first pages.
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        names = parquet.schema_arrow.names
    except Exception as exc:  # not a parquet file, truncated footer, ...
        raise _unreadable(label, path, exc) from exc
    _check_columns(label, names, prompt_key, source_key)
    meta = parquet.metadata
    if meta.num_rows == 0:
        raise DataError(f"{label}: {path} has no rows; training needs at least one prompt")
    columns = [c for c in dict.fromkeys((source_key, prompt_key, "ability", "reward_model", "extra_info", "agent_name")) if c in names]
    groups = _spread(meta.num_row_groups, sample_rows)
    per_group = max(1, sample_rows // len(groups))
    starts = [0]
    for g in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(g).num_rows)
    records: list[PromptRecord] = []
    try:
        for g in groups:
            batch = next(parquet.iter_batches(batch_size=per_group, row_groups=[g], columns=columns), None)
            if batch is not None:
                records += _check_table(label, batch, prompt_key, range(starts[g], starts[g] + batch.num_rows), source_key)
    except DataError:
        raise
    except Exception as exc:  # a damaged page
        raise _unreadable(label, path, exc) from exc
    return records


def _spread(count: int, at_most: int) -> list[int]:
    """At most ``at_most`` indices of range(count), evenly spread, first and last included."""
    if count <= at_most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (at_most - 1)) for i in range(at_most)})


def _check_exists(label: str, path: str | Path) -> None:
    if Path(path).is_dir():  # e.g. a folder of parquet shards: "does not exist" would be untrue
        raise DataError(f"{label}: {path} is a directory, not a parquet file; give the file itself")
    if not Path(path).is_file():
        raise DataError(f"{label}: file {path} does not exist; check the path (relative paths are relative to the working directory)")


def _unreadable(label: str, path: str | Path, exc: Exception) -> DataError:
    twice = _repeated_columns(path)
    if twice:  # pyarrow's own message dumps the whole schema
        return DataError(f"{label}: {path} has the column(s) {', '.join(twice)} more than once (an older megarl evaluate "
                         "--scored wrote 'scores' again); score the generated file instead, or write this one with each column once")  # fmt: skip
    return DataError(f"{label}: cannot read {path} as parquet ({exc}); {SCHEMA_HELP}")


def _repeated_columns(path: str | Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception:  # noqa: BLE001 - not parquet at all: the caller's message says so
        return []
    return sorted({n for n in names if names.count(n) > 1})


def _check_columns(label: str, columns: list[str], prompt_key: str, source_key: str = "data_source") -> None:
    for name in (source_key, "reward_model", prompt_key):
        if name not in columns:
            hint = (f" (data.prompt_key is {prompt_key!r})" if name == prompt_key
                    else f" (data.reward_fn_key is {source_key!r})" if name == source_key != "data_source" else "")
            raise DataError(f"{label}: missing column {name!r}{hint}; the file has columns {columns}; {SCHEMA_HELP}")


def _check_table(label: str, table: Any, prompt_key: str, rows: range, source_key: str = "data_source") -> list[PromptRecord]:
    """Check the rows of an arrow table or record batch; ``rows`` are their numbers in the file."""
    names = table.schema.names
    data = {name: table.column(name).to_pylist() for name in (source_key, "reward_model", prompt_key)}
    ability = table.column("ability").to_pylist() if "ability" in names else [None] * table.num_rows
    extra = table.column("extra_info").to_pylist() if "extra_info" in names else [None] * table.num_rows
    agents = table.column("agent_name").to_pylist() if "agent_name" in names else [None] * table.num_rows
    return [
        _check_row(label, row, data[source_key][i], data[prompt_key][i], prompt_key, ability[i], data["reward_model"][i],
                   extra[i], agents[i], source_key)  # fmt: skip
        for i, row in enumerate(rows)
    ]


def _check_row(
    label: str, i: int, data_source: Any, prompt: Any, prompt_key: str, ability: Any, reward_model: Any, extra_info: Any,
    agent_name: Any = None, source_key: str = "data_source",
) -> PromptRecord:
    def bad(column: str, expected: str, value: Any) -> DataError:
        return DataError(f"{label}: row {i}, column {column!r}: expected {expected}, got {type_name(value)} ({short_repr(value)})")

    if not isinstance(data_source, str) or not data_source:
        raise bad(source_key, "a non-empty string", data_source)
    checked = check_prompt(prompt, f"{label}: row {i}, column {prompt_key!r}")
    if ability is not None and not isinstance(ability, str):
        raise bad("ability", "a string", ability)
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise bad("reward_model", "a struct {ground_truth, style}", reward_model)
    style = reward_model.get("style")
    if style is not None and not isinstance(style, str):
        raise bad("reward_model.style", "a string", style)
    if extra_info is not None and not isinstance(extra_info, dict):
        raise bad("extra_info", "a struct (dict) or null", extra_info)
    if agent_name is not None and not isinstance(agent_name, str):
        raise bad("agent_name", "a string or null", agent_name)
    extra = dict(extra_info or {})
    others = {k: without_nulls(v) for k, v in reward_model.items() if k != "ground_truth" and v is not None}
    if set(others) - {"style"}:  # the struct's own fields reach the scorer (verl passes extra_info only)
        extra.setdefault("reward_model", others)
    return PromptRecord(
        data_source=data_source,
        prompt=checked,
        ground_truth=reward_model["ground_truth"],
        row=i,
        ability=ability or "",
        style=style or "rule",
        extra_info=extra,
        agent_name=agent_name or "",
    )


def record_of_row(label: str, i: int, row: Any, *, prompt_key: str = "prompt", source_key: str = "data_source") -> PromptRecord:
    """A row dict of a user's dataset class (data.custom_cls) checked as a parquet row is: the
    data source (``source_key``), the prompt (``prompt_key``, else verl's ``raw_prompt``),
    reward_model, and the optional extra_info, ability and agent_name; numpy values as lists."""
    if not isinstance(row, dict):
        raise DataError(f"{label}: row {i} is {type_name(row)} ({short_repr(row)}); __getitem__ must return a dict in the "
                        f"verl schema ({source_key}, {prompt_key}, reward_model, extra_info)")
    key = prompt_key if prompt_key in row else "raw_prompt" if "raw_prompt" in row else None
    for name, present in ((source_key, source_key in row), (prompt_key, key is not None), ("reward_model", "reward_model" in row)):
        if not present:
            hint = " or 'raw_prompt'" if name == prompt_key else ""
            raise DataError(f"{label}: row {i} has no key {name!r}{hint} (it has {sorted(map(str, row))}); {SCHEMA_HELP}")
    assert key is not None  # the loop refused a row without a prompt
    plain = {k: _plain(v) for k, v in row.items()}
    return _check_row(label, i, plain[source_key], plain[key], key, plain.get("ability"), plain["reward_model"],
                      plain.get("extra_info"), plain.get("agent_name"), source_key)


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars (what pandas rows hold) as Python lists and numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if not isinstance(value, (str, bytes)) and callable(getattr(value, "tolist", None)):
        return _plain(value.tolist())
    return value


def check_prompt(prompt: Any, where: str) -> Prompt:
    """``prompt`` as a :data:`Prompt`: text, or chat messages checked by :func:`check_messages`.

    ``where`` starts every error (``train.parquet: row 17, column 'prompt'``)."""
    if isinstance(prompt, str):
        _refuse_encoded_messages(prompt, where)
        return prompt
    if isinstance(prompt, list):
        return check_messages(prompt, where)
    raise DataError(f"{where}: expected a string or a list of {{role, content}} messages, got {type_name(prompt)} "
                    f"({short_repr(prompt)}); give text as a string (quote a number) or messages as a list")


# "[{ ... }]", spaces allowed: how a list of messages looks written out as text.
_LIST_OF_OBJECTS = re.compile(r"\[\s*\{.*\}\s*\]", re.DOTALL)


def _refuse_encoded_messages(text: str, where: str) -> None:
    """Refuse a text prompt that is chat messages written out as text: JSON (``json.dumps`` of the
    list) or Python's repr (what pandas' ``to_csv`` writes for a list cell). As text it would
    reach the model, brackets and keys included, as one user message."""
    stripped = text.strip()
    if not _LIST_OF_OBJECTS.fullmatch(stripped):
        return  # the cheap test: most prompts fail at their first character
    import ast
    import json

    try:
        value = json.loads(stripped)
    except ValueError:
        try:
            value = ast.literal_eval(stripped)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        raise DataError(f"{where}: the text is chat messages written out as a string ({short_repr(text)}), which the "
                        "model would see as one user message; store them as a list of {role, content} structs "
                        "(json.loads or ast.literal_eval the text before writing; a CSV cell is always text: use JSONL)")  # fmt: skip


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Chat messages checked; the one check of a message list (RL prompts, ``megarl data
    convert``, SFT conversations). An error names the message (numbered from 0, as the list's
    index), the key, its value and the fix.

    Keys besides role and content (an assistant turn's ``tool_calls``, a tool message's ``name``
    and ``tool_call_id``) are kept for the chat template, except null values, at any depth:
    parquet gives every message (and every object inside one) each key that any row of the column
    has, null where the row has none, so a null reads as an absent key."""
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if isinstance(messages, list) else f"{type_name(messages)} ({short_repr(messages)})"
        raise DataError(f"{where}: expected a non-empty list of {{role, content}} messages, got {shown}")
    checked: list[dict[str, Any]] = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {n} is {type_name(m)} ({short_repr(m)}); give each message as a {{role, content}} object")
        # An assistant turn that calls tools may carry no text (OpenAI's format: content null or absent).
        calls = m.get("role") == "assistant" and bool(m.get("tool_calls"))
        for key in ("role",) if calls else ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: message {n} has no {key!r} key (it has {sorted(m)}); give each message a role and a content")
        role, content = m["role"], m.get("content")
        if role not in ROLES:  # also a non-string role
            raise DataError(f"{where}: message {n} has role {role!r}{_close_role(role)}; roles are {', '.join(ROLES)}")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: message {n} has content {short_repr(content)} ({type_name(content)}); a message's "
                            "content must be a string (quote a number, join a list of parts into one text; null only "
                            "in an assistant message with tool_calls)")  # fmt: skip
        others = {key: without_nulls(value) for key, value in m.items() if key not in ("role", "content") and value is not None}
        checked.append({"role": role, "content": content, **others})
    return checked


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of its objects dropped (list items are kept): in a
    parquet struct column a null is a key the row did not have (messages here; a row's
    tools_kwargs and interaction_kwargs in megarl/rollout/agents)."""
    if isinstance(value, dict):
        return {key: without_nulls(v) for key, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


# Roles of other chat formats, and the role that plays their part here.
_ROLE_ALIASES = {"developer": "system", "human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant",
                 "function": "tool", "ipython": "tool", "observation": "tool"}  # fmt: skip


def _close_role(role: Any) -> str:
    if isinstance(role, str) and role.lower() in _ROLE_ALIASES:
        return f" (use {_ROLE_ALIASES[role.lower()]!r} for it)"
    close = difflib.get_close_matches(role.lower(), ROLES, n=1, cutoff=0.6) if isinstance(role, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def type_name(value: Any) -> str:
    """A value's JSON-ish type name for errors (None reads as null, as in the user's file)."""
    return "null" if value is None else type(value).__name__


def prompt_chars(prompt: Prompt) -> int:
    """Characters of a prompt's text (all message contents), for token-free statistics."""
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def write_prompt_file(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write verl-schema rows (dicts with the columns above) to a parquet file; returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataError(f"{path}: refusing to write a parquet file with no rows")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a failure never leaves half a file, nor destroys an old one.
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def training_rows(cfg: Any) -> int | None:
    """The rows of the training files from their parquet footers (None when one cannot be read:
    the preflight reports that); at most the prompts a run keeps, which may drop overlong ones."""
    import pyarrow.parquet as pq

    if cfg.data.custom_cls is not None:  # the user's class reads the files: no footer counts its rows
        return None
    try:
        return sum(pq.read_metadata(f.path).num_rows for f in cfg.data.train_files)
    except Exception:  # noqa: BLE001 - any unreadable file
        return None
