"""Parquet files of generated responses: what `megarl generate` writes and `megarl evaluate` reads.

One row per prompt: the input file's columns (the verl schema, megarl/data/datasets.py) plus

    prompt_text       str              the prompt as the engine saw it (chat template applied)
    responses         list[str]        the n responses, decoded (a final EOS dropped)
    response_lengths  list[int]        tokens of each response
    finish_reasons    list[str]        stop | length | abort, or an agent loop's (max_turns, max_tool_calls,
                                       tool_error, timeout), per response
    turns             list[int]        model turns of each response (1 unless an agent loop ran, docs/agents.md)
    tool_calls        list[int]        tool calls of each response (0 unless an agent loop ran)

and, in a file `megarl evaluate --scored` writes, ``scores`` (list[float], one per response).
These columns belong to one generation: `megarl generate` given such a file as --data drops
them (the new responses replace them) and `megarl evaluate --scored` replaces ``scores``.

Any parquet in the verl schema with a ``responses`` list column can be evaluated; the other
three columns are optional there (without them, the length and truncation statistics are left
out and rewards that read the prompt get the raw prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.data.datasets import DataError, PromptRecord, read_prompt_file, short_repr

PROMPT_TEXT, RESPONSES, LENGTHS, REASONS = "prompt_text", "responses", "response_lengths", "finish_reasons"
TURNS, TOOL_CALLS = "turns", "tool_calls"  # agent loops' counts (1 and 0 for a single-turn response)
SCORES = "scores"  # evaluate --scored: the reward of each response
GENERATED_COLUMNS = (PROMPT_TEXT, RESPONSES, LENGTHS, REASONS, TURNS, TOOL_CALLS, SCORES)


@dataclass(frozen=True)
class GeneratedRows:
    """The checked rows of a generated file; per-response lists aligned with ``responses``."""

    records: list[PromptRecord]
    responses: list[list[str]]
    lengths: list[list[int]] | None
    finish_reasons: list[list[str]] | None
    prompt_text: list[str] | None


def read_generated(path: str | Path, *, label: str = "--data", prompt_key: str = "prompt") -> GeneratedRows:
    """Read and check a generated file; errors name the file, the row and the column."""
    import pyarrow.parquet as pq

    records = read_prompt_file(path, label=label, prompt_key=prompt_key)
    table = pq.read_table(path)
    where = f"{label} ({Path(path).name})"
    if RESPONSES not in table.column_names:
        raise DataError(f"{where} has no '{RESPONSES}' column (found: {', '.join(table.column_names)}); evaluate "
                        "reads what `megarl generate` writes")  # fmt: skip
    read = (PROMPT_TEXT, RESPONSES, LENGTHS, REASONS)  # what evaluate uses
    columns = {name: table.column(name).to_pylist() if name in table.column_names else None for name in read}
    responses = columns[RESPONSES]
    assert responses is not None  # the column is there (checked above)
    for row, answers in enumerate(responses):
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"{where}: row {row}, column '{RESPONSES}': expected a non-empty list of strings, got {short_repr(answers)}")
        for name, fits, what in ((LENGTHS, _is_count, "token counts"), (REASONS, _is_text, "finish reasons (stop, length, ...)")):
            values = columns[name]
            # a null among them stopped the statistics with a TypeError after all the scoring
            if values is not None and (not isinstance(values[row], list) or len(values[row]) != len(answers)
                                       or not all(map(fits, values[row]))):  # fmt: skip
                raise DataError(f"{where}: row {row}, column '{name}': expected {len(answers)} {what} (one per response), "
                                f"got {short_repr(values[row])}")  # fmt: skip
    return GeneratedRows(records, responses, columns[LENGTHS], columns[REASONS], columns[PROMPT_TEXT])


def _is_count(value: object) -> bool:
    """A token count: a whole number (a float column's 3.0 too, as pandas writes ints beside a null)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return float(value).is_integer() and value >= 0


def _is_text(value: object) -> bool:
    return isinstance(value, str)
