"""What `megarl data inspect` reports about a prompt file: rows, columns, data sources, lengths.

Reading goes through the same checks as training (megarl/data/datasets.py), so inspect also
validates a file. Prompt lengths are in tokens after templating when a tokenizer is given, in
characters of the prompt text otherwise. Nothing is modified.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megarl.data.datasets import DataError, prompt_chars, read_prompt_file
from megarl.data.prompts import PromptBuilder

PERCENTILES = (50, 90, 99)
EXAMPLE_CHARS = 200  # of each text of the example row: a whole 100 MB prompt would flood the terminal


@dataclass(frozen=True)
class DatasetSummary:
    path: str
    rows: int
    columns: dict[str, str]  # name -> arrow type
    data_sources: dict[str, int]  # most common first
    length_unit: str  # "tokens" | "characters"
    lengths: dict[str, float]  # p50, p90, p99, max, mean
    over_limit: int | None  # prompts longer than max_prompt_length (when given)
    max_prompt_length: int | None
    example: dict[str, Any]  # the first row's prompt and ground truth, long texts cut (see shortened)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_tokenizer(path: str | Path) -> Any:
    """An HF tokenizer from a model / tokenizer directory (no download)."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is a file"
        raise DataError(f"--tokenizer {path} {what}; give an HF model (or tokenizer) directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError / ... for a bad dir
        reason = " ".join(str(exc).split())  # transformers' messages run over several lines
        raise DataError(f"--tokenizer {path}: cannot load a tokenizer from it ({reason}); give an HF model directory") from exc


def summarize_prompt_file(
    path: str | Path,
    tokenizer: Any = None,
    *,
    prompt_key: str = "prompt",
    apply_chat_template: bool = True,
    max_prompt_length: int | None = None,
) -> DatasetSummary:
    import pyarrow.parquet as pq

    records = read_prompt_file(path, label=str(path), prompt_key=prompt_key)
    schema = pq.read_schema(path)
    if tokenizer is not None:
        use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        builder = PromptBuilder(tokenizer, max_prompt_length=1 << 30, truncation="right", apply_chat_template=use_template)
        wheres = [f"{path}: row {r.row}" for r in records]
        lengths = builder.lengths([r.prompt for r in records], wheres)
        unit = "tokens"
    else:
        lengths = [prompt_chars(r.prompt) for r in records]
        unit = "characters"
    arr = np.asarray(lengths, dtype=np.int64)
    stats: dict[str, float] = {}
    if arr.size:
        # inverted_cdf: every percentile is a length that occurs in the data.
        stats = {f"p{q}": float(np.percentile(arr, q, method="inverted_cdf")) for q in PERCENTILES}
        stats |= {"max": float(arr.max()), "mean": round(float(arr.mean()), 1)}
    over = None
    if max_prompt_length is not None and unit == "tokens":
        over = int((arr > max_prompt_length).sum())
    example = {"prompt": shortened(records[0].prompt), "ground_truth": shortened(records[0].ground_truth)} if records else {}
    return DatasetSummary(
        path=str(path),
        rows=len(records),
        columns={name: str(schema.field(name).type) for name in schema.names},
        data_sources=dict(Counter(r.data_source for r in records).most_common()),
        length_unit=unit,
        lengths=stats,
        over_limit=over,
        max_prompt_length=max_prompt_length if unit == "tokens" else None,
        example=example,
    )


def shortened(value: Any, limit: int = EXAMPLE_CHARS) -> Any:
    """``value`` with each string (also in messages) cut to ``limit`` characters, saying how many were cut."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}... [{len(value) - limit} more characters]"
    if isinstance(value, list):
        return [shortened(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: shortened(v, limit) for k, v in value.items()}
    return value


def format_summary(s: DatasetSummary) -> str:
    """A human-readable report."""
    no_rows = "  (megarl launch refuses a file with no rows)" if s.rows == 0 else ""
    lines = [f"{s.path}: {s.rows} rows{no_rows}", "columns:"]
    lines += [f"  {name}: {kind}" for name, kind in s.columns.items()]
    lines.append("data_source:")
    lines += [f"  {name}: {count}" for name, count in s.data_sources.items()]
    if s.lengths:
        parts = "  ".join(f"{k}={v:g}" for k, v in s.lengths.items())
        lines.append(f"prompt length ({s.length_unit}): {parts}")
    if s.over_limit is not None:
        lines.append(f"prompts over max_prompt_length ({s.max_prompt_length}): {s.over_limit}")
    if s.example:
        lines.append(f"first row: prompt={s.example['prompt']!r} ground_truth={s.example['ground_truth']!r}")
    return "\n".join(lines)
