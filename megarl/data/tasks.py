"""Synthetic task data for the CPU demo: reverse a string of digits ("472" -> "274").

Why this task: a tiny random-init model learns it with GRPO on a CPU in minutes (attention
learns the positional copy): in a measured probe (2-layer, hidden-64 Qwen2, 32 prompts x 8
samples, 800 train / 200 held-out strings) held-out reward rose from 0.08 to 0.67 in 200 steps,
while (a + b) mod 10 on held-out pairs did not move at all. Every digit string of ``num_digits`` digits is generated once, shuffled with the
seed and split, so a held-out prompt never appears in training. Rows follow the verl schema:
the prompt is one user message whose content is the digit string, the ground truth is the
reversed string. The reward (partial credit per position) lives in megarl/rewards/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megarl.data.datasets import DataError, write_prompt_file

REVERSE_DIGITS = "reverse_digits"
TASK_VOCAB = "0123456789"  # the tiny model's task_vocab for this task


def reverse_digits_rows(
    *, num_digits: int = 3, val_size: int = 200, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows) covering every ``num_digits``-digit string exactly once."""
    if not 1 <= num_digits <= 6:
        raise DataError(f"--digits must be between 1 and 6, got {num_digits}")
    total = 10**num_digits
    if not 0 < val_size < total:
        raise DataError(f"--val-size must be between 1 and {total - 1} for {num_digits} digits, got {val_size}")
    order = np.random.default_rng([seed % (1 << 63), num_digits]).permutation(total)
    strings = [str(int(k)).zfill(num_digits) for k in order]
    held_out, train = strings[:val_size], strings[val_size:]
    return _rows(train, "train"), _rows(held_out, "test")


def _rows(strings: list[str], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": REVERSE_DIGITS,
            "prompt": [{"role": "user", "content": s}],
            "ability": "copy",
            "reward_model": {"ground_truth": s[::-1], "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i, s in enumerate(strings)
    ]


def write_reverse_digits(
    out_dir: str | Path, *, num_digits: int = 3, val_size: int = 200, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns both paths."""
    train, val = reverse_digits_rows(num_digits=num_digits, val_size=val_size, seed=seed)
    out = Path(out_dir)
    return write_prompt_file(train, out / "train.parquet"), write_prompt_file(val, out / "val.parquet")
