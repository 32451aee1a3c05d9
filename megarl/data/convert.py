"""Converters from raw JSONL / CSV files to verl-schema parquet (``megarl data gsm8k|math|convert``).

- GSM8K (``question`` / ``answer``): the ground truth is the text after the last ``####`` of the
  answer, commas removed ("1,234" -> "1234"), refused unless it is a number the gsm8k reward can
  match ("18 dollars" never would be); data_source ``openai/gsm8k`` (what the gsm8k
  reward is keyed on); the prompt asks for the answer after "####".
- MATH (``problem`` / ``solution``): the ground truth is the content of the solution's last
  ``\\boxed{...}`` (nested braces kept; an empty box is refused); data_source ``math``; the
  prompt asks for a boxed answer.
- generic: any prompt / answer field names, a data_source of the user's choice, an optional
  system message and instruction suffix. The prompt is text or a list of {role, content}
  messages (checked as training checks them; other keys such as tool_calls are kept when the
  parquet file gives them back as given, and refused otherwise); the ground truth is text or a
  number, stored as text (number_text: 3.0 -> "3", 1e-5 -> "0.00001"). A number as a prompt,
  or a bool / list / object as a ground truth, is refused.

Bad input raises :class:`~megarl.data.datasets.DataError` naming the file, the line and the
field. Nothing here downloads datasets: the user brings the raw files.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from megarl.data.datasets import (
    DataError,
    Prompt,
    check_messages,
    check_prompt,
    short_repr,
    type_name,
    write_prompt_file,
)
from megarl.rewards.answers import number_text
from megarl.rewards.gsm8k import reference_number  # the number the gsm8k reward compares with
from megarl.rewards.math import last_boxed  # one definition for data conversion and scoring

GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "math"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# `megarl data gsm8k --tools`: the calculator of configs/tools/calculator.yaml (docs/agents.md).
GSM8K_TOOL_SYSTEM = ("You are a math expert. Solve the problem step by step. For arithmetic, call the calculator "
                     "tool with an expression; use its answer. Output the final answer after \"####\".")  # fmt: skip
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
READABLE = (".jsonl", ".csv")


@dataclass(frozen=True)
class RawRecord:
    """One input record and where it came from (for errors)."""

    fields: dict[str, Any]
    where: str  # "train.jsonl: line 12"

    def get(self, name: str, *, option: str = "") -> Any:
        """The field's value, its JSON numbers with a point or exponent as floats."""
        return _floats(self._exact(name, option=option))

    def _exact(self, name: str, *, option: str = "") -> Any:
        """The field's value as read: a JSONL number with a point or exponent is a Decimal."""
        if name in self.fields and self.fields[name] is None:
            raise DataError(f"{self.where}: field {name!r} is null; give it a value or drop the record")
        if name not in self.fields:
            hint = f"; choose the field with {option}" if option else ""
            raise DataError(f"{self.where}: missing field {name!r}; the record has fields {sorted(self.fields)}{hint}")
        return self.fields[name]

    def text(self, name: str, *, option: str = "") -> str:
        """A text field (a prompt, a solution): a non-empty string. A JSON number is refused, not
        turned into text: a prompt that is a number is most often the wrong field."""
        value = self.get(name, option=option)
        if not isinstance(value, str):
            raise DataError(f"{self.where}: field {name!r} must be a string, got {type_name(value)} ({short_repr(value)}); "
                            "quote it in the JSON if it is meant as text")  # fmt: skip
        return self._nonempty(name, value)

    def ground_truth(self, name: str, *, option: str = "") -> str:
        """A ground truth: a string, or a finite number (common in math data) stored as
        :func:`number_text` writes it. A bool, list or object has no one answer text and is
        refused, as is a null (by get)."""
        value = self._exact(name, option=option)
        if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
            raise DataError(f"{self.where}: field {name!r} must be a string or a number, got {type_name(value)} "
                            f"({short_repr(_floats(value))}); write the answer as one string, quoted in the JSON")  # fmt: skip
        if isinstance(value, str):
            return self._nonempty(name, value)
        if isinstance(value, float) and not math.isfinite(value):  # JSON NaN / Infinity: no answer to compare with
            raise DataError(f"{self.where}: field {name!r} is {value}, not a finite number; give the answer")
        try:  # beyond the digits a real answer has (1e-999999 would be a million), it is a mistake
            return self._nonempty(name, number_text(value))
        except ValueError as exc:
            raise DataError(f"{self.where}: field {name!r}: {exc}; write the answer as a string, quoted in the JSON") from None

    def _nonempty(self, name: str, value: str) -> str:
        text = value.strip()
        if not text:
            raise DataError(f"{self.where}: field {name!r} is empty")
        return text


def _floats(value: Any) -> Any:
    """``value`` with its Decimals as floats (what json gives for a number with a point)."""
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, dict):
        return {key: _floats(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def read_raw_records(path: str | Path) -> Iterator[RawRecord]:
    """Records of a ``.jsonl`` (one JSON object per line) or ``.csv`` (header row) file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    if p.suffix not in READABLE:
        raise DataError(f"{path}: unsupported input format {p.suffix or '(none)'!r}; give a .jsonl or .csv file")
    try:
        yield from _text_records(p)
    except UnicodeDecodeError:
        raise DataError(_not_utf8(p)) from None


def _text_records(p: Path) -> Iterator[RawRecord]:
    with p.open(encoding="utf-8-sig", newline="") as fh:  # -sig: a spreadsheet's byte-order mark is no field name
        if p.suffix == ".csv":
            yield from _csv_records(fh, p.name)
            return
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_float=Decimal)  # exact: a ground truth's digits are its text
            except json.JSONDecodeError as exc:
                raise DataError(f"{p.name}: line {n}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            except ValueError:  # an integer of more digits than Python reads (sys.get_int_max_str_digits)
                raise DataError(f"{p.name}: line {n}: a number has more than {sys.get_int_max_str_digits()} digits; "
                                "write it as a string, quoted in the JSON") from None
            if not isinstance(obj, dict):
                raise DataError(f"{p.name}: line {n}: expected a JSON object, got {type(obj).__name__}")
            yield RawRecord(obj, f"{p.name}: line {n}")


def _not_utf8(p: Path) -> str:
    """Where ``p`` first stops being UTF-8 (the decoder reads ahead in blocks, so its error has no
    line): line, byte and column, and the fix."""
    with p.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[: exc.start].decode("utf-8")) + 1
                return (f"{p.name}: line {n}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); re-encode the "
                        f"file (e.g. iconv -f latin1 -t utf-8 {p.name} > {p.stem}.utf8{p.suffix})")  # fmt: skip
    return f"{p.name}: not UTF-8; re-encode the file (e.g. iconv -f latin1 -t utf-8)"  # not reached: an invalid sequence lies within a line


def _csv_records(fh: Any, name: str) -> Iterator[RawRecord]:
    """The rows of a CSV file under its header's names (each name once); a row with another number
    of cells is refused (a short row's missing cells are not null values, and a long row's surplus
    is most often an unquoted comma that has shifted every cell after it)."""
    reader = csv.reader(fh)
    header = next((cells for cells in reader if cells), [])  # the first line that is not blank
    seen: set[str] = set()
    for column, field in enumerate(header, start=1):
        if field in seen:  # a record keeps one value per name: the other column would be dropped unseen
            raise DataError(f"{name}: line {reader.line_num}: the header names the column {field!r} twice (again in column {column}); "
                            "give each column its own name")  # fmt: skip
        seen.add(field)
    for cells in reader:
        if not cells:  # a blank line
            continue
        if len(cells) != len(header):
            fix = "quote any cell that holds a comma" if len(cells) > len(header) else "add the missing cells or drop the row"
            cells_text = f"{len(cells)} cell" + ("s" if len(cells) != 1 else "")
            raise DataError(f"{name}: line {reader.line_num}: the row has {cells_text} where the header has {len(header)}; "
                            f"{fix}")  # fmt: skip
        yield RawRecord(dict(zip(header, cells)), f"{name}: line {reader.line_num}")


# ---- answer extraction ---------------------------------------------------------------------
def gsm8k_final_answer(answer: str) -> str | None:
    """The text after the last ``####`` with thousands separators removed, or None."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


# ---- per-format rows ------------------------------------------------------------------------
def _user_prompt(text: str, suffix: str = "", system: str = "") -> list[dict[str, Any]]:
    return _framed([{"role": "user", "content": text}], system, suffix, where="")  # one message: nothing to refuse


def _framed(messages: list[dict[str, Any]], system: str, suffix: str, where: str) -> list[dict[str, Any]]:
    """Messages with ``system`` (--system) put first and ``suffix`` (--suffix) after the last
    user message's text, following a space. Messages with a system message of their own are
    refused rather than given a second one (or one of the two dropped)."""
    if system:
        own = next((n for n, m in enumerate(messages) if m["role"] == "system"), None)
        if own is not None:
            raise DataError(f"{where}: --system is given but the messages already have a system message (message {own}); "
                            "drop --system, or that message from the row")  # fmt: skip
        messages = [{"role": "system", "content": system}, *messages]
    if suffix:
        users = [n for n, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: --suffix is given but the messages have no user message to append it to; "
                            "drop --suffix, or add a user message to the row")  # fmt: skip
        last = messages[users[-1]]
        messages = [*messages[: users[-1]], {**last, "content": f"{last['content']} {suffix}"}, *messages[users[-1] + 1 :]]
    return messages


def _row(source: str, prompt: Prompt, truth: str, ability: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_source": source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": extra,
    }


def gsm8k_rows(path: str | Path, *, split: str = "train", tools: bool = False) -> list[dict[str, Any]]:
    """GSM8K rows; ``tools``: the tool-use variant (a system prompt that offers the calculator,
    agent_name tool_agent)."""
    rows = []
    for i, rec in enumerate(read_raw_records(path)):
        question, answer = rec.text("question"), rec.text("answer")
        final = gsm8k_final_answer(answer)
        if final is None:
            raise DataError(f"{rec.where}: field 'answer' has no final answer after '####' (GSM8K answers end with '#### <number>')")
        if reference_number(final) is None:  # the gsm8k reward compares numbers: every response would score 0
            raise DataError(f"{rec.where}: field 'answer' ends with '#### {final}', which is not a number the gsm8k reward can "
                            "match; write the number alone after '####' (commas and $ allowed), or convert the file with "
                            "`megarl data convert` and a data source of another reward")  # fmt: skip
        extra = {"split": split, "index": i, "question": question, "answer": answer}
        if tools:
            row = _row(GSM8K_SOURCE, _user_prompt(question, system=GSM8K_TOOL_SYSTEM), final, "math", extra)
            rows.append({**row, "agent_name": "tool_agent"})
        else:
            rows.append(_row(GSM8K_SOURCE, _user_prompt(question, GSM8K_INSTRUCTION), final, "math", extra))
    return rows


def math_rows(path: str | Path, *, split: str = "train") -> list[dict[str, Any]]:
    rows = []
    for i, rec in enumerate(read_raw_records(path)):
        problem, solution = rec.text("problem"), rec.text("solution")
        final = last_boxed(solution)
        if final is None:
            raise DataError(f"{rec.where}: field 'solution' has no complete \\boxed{{...}} answer")
        if not final.strip():  # a blank ground truth: the math reward would score every response 0
            raise DataError(f"{rec.where}: field 'solution' has an empty last \\boxed{{}}; put the answer in it")
        extra = {"split": split, "index": i, "problem": problem, "solution": solution}
        rows.append(_row(MATH_SOURCE, _user_prompt(problem, MATH_INSTRUCTION), final, "math", extra))
    return rows


def generic_rows(
    path: str | Path,
    *,
    prompt_field: str,
    answer_field: str,
    data_source: str,
    system: str = "",
    suffix: str = "",
    ability: str = "",
    split: str = "train",
) -> list[dict[str, Any]]:
    """Rows from any JSONL / CSV: a string prompt becomes a user message, a JSONL prompt that is
    already a list of {role, content} messages is kept (checked as training checks it); both get
    ``system`` and ``suffix``. The ground truth is a string or a number, stored as text."""
    if not data_source:
        raise DataError("--data-source must be a non-empty name (the reward functions are chosen by it)")
    rows, wheres = [], []
    for i, rec in enumerate(read_raw_records(path)):
        raw, where = rec.get(prompt_field, option="--prompt-field"), f"{rec.where}: field {prompt_field!r}"
        checked = check_prompt(rec.text(prompt_field) if isinstance(raw, str) else raw, where)
        if isinstance(checked, str):
            prompt: Prompt = _user_prompt(checked, suffix, system)
        else:  # messages (check_prompt refuses anything else)
            prompt = _framed(checked, system, suffix, where)
        truth = rec.ground_truth(answer_field, option="--answer-field")
        rows.append(_row(data_source, prompt, truth, ability, {"split": split, "index": i}))
        wheres.append(where)
    _check_storable([row["prompt"] for row in rows], wheres, f"{Path(path).name}: field {prompt_field!r}")
    return rows


def _check_storable(prompts: list[list[dict[str, Any]]], wheres: list[str], column: str) -> None:
    """Refuse message keys besides role and content (tool_calls, name, ...) that the parquet
    file would not give back as given: a column has one type, so every row's messages get each
    key that any row has (null where missing: read as absent), an object inside a message the
    key order of the first row that has it, and a number is an int in every row or a float in
    every row. ``column`` names the file and field for an error that is no one row's."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    if all(m.keys() <= {"role", "content"} for p in prompts for m in p):
        return  # strings only: nothing for parquet to change
    try:
        table = pa.table({"prompt": pa.array(prompts)})
    except (pa.ArrowException, OverflowError) as exc:
        raise DataError(f"{wheres[_first_unstorable(prompts)]}: its messages' keys do not fit one parquet column with the "
                        f"rows before ({exc}); give each key the same type (object, list, text or number) in every row") from exc  # fmt: skip
    buffer = io.BytesIO()
    try:
        pq.write_table(table, buffer)
    except (pa.ArrowException, OverflowError) as exc:  # an object that is empty ({}) in every row has no parquet type
        raise DataError(f"{column}: the messages' keys cannot be stored in parquet ({exc}); drop that key, or give the "
                        "object a key in some row") from exc  # fmt: skip
    stored = pq.read_table(io.BytesIO(buffer.getvalue())).column("prompt").to_pylist()
    for given, back, where in zip(prompts, stored, wheres, strict=True):
        for n, (mine, read) in enumerate(zip(given, check_messages(back, where), strict=True)):
            # The order of a message's own keys matters to no template; inside its values it
            # may (tojson of a tool call's arguments).
            diff = next((d for key in mine if (d := _first_difference(mine[key], read.get(key), key))), None)
            if diff is not None:
                raise DataError(f"{where}: message {n}'s {diff[0]} would read back from parquet as {short_repr(diff[2])}, "
                                f"not {short_repr(diff[1])} (a parquet column keeps one key order and one number type "
                                "for all rows); give it the key order and number type of the earlier rows")  # fmt: skip


def _first_unstorable(prompts: list[list[dict[str, Any]]]) -> int:
    """The first prompt that no parquet column can hold together with the prompts before it
    (bisected: a prefix that fails fails longer too)."""
    import pyarrow as pa

    good, bad = 0, len(prompts)  # prompts[:good] convert, prompts[:bad] do not
    while bad - good > 1:
        mid = (good + bad) // 2
        try:
            pa.array(prompts[:mid])
            good = mid
        except (pa.ArrowException, OverflowError):
            bad = mid
    return bad - 1


def _first_difference(given: Any, read: Any, path: str) -> tuple[str, Any, Any] | None:
    """(path, given part, read part) of the first place where ``read`` differs from ``given``,
    key order and int / float included; None when they are the same."""
    if isinstance(given, dict) and isinstance(read, dict) and list(given) == list(read):
        parts = [(f"{path}.{key}", given[key], read[key]) for key in given]
    elif isinstance(given, list) and isinstance(read, list) and len(given) == len(read):
        parts = [(f"{path}[{i}]", g, r) for i, (g, r) in enumerate(zip(given, read, strict=True))]
    elif isinstance(given, dict) or type(given) is not type(read) or given != read:
        return path, given, read  # a dict here: its keys come back in another order
    else:
        return None
    return next((d for p, g, r in parts if (d := _first_difference(g, r, p)) is not None), None)


def write_rows(rows: list[dict[str, Any]], out: str | Path, source: str | Path) -> Path:
    if not rows:
        raise DataError(f"{source}: no records found (empty file?)")
    return write_prompt_file(rows, out)
