"""Synthetic data for the tool-use demo (configs/tiny_tool_agent.yaml): add two numbers with the
calculator.

The prompt is the sum to do, ``"123+45"`` (two numbers of 2 or 3 digits). A correct trajectory is
two model turns around one tool answer, each marker a single token of the demo's vocabulary::

    <tool_call>123+45</tool_call>   (the model's call: the prompt copied between the markers)
    168                             (the calculator's answer: context, never trained)
    168                             (the model's final answer: the tool's answer copied)

Why this task: a tiny random-init model cannot learn to add (megarl/data/tasks.py), but it can
learn to copy, and with the tool copying is all the task asks. Every pair is drawn once with the
seed and split, so a held-out sum never appears in training. Rows follow the verl schema with
``agent_name: tool_agent``; ``sft.parquet`` holds the correct trajectories of the training sums
as chat conversations (`megarl sft` trains on their assistant turns only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megarl.data.datasets import DataError, write_prompt_file
from megarl.rewards.tool_sum import CALL_CLOSE, CALL_OPEN

TOOL_SUM = "tool_sum"  # the data_source, and the name of its scorer (megarl/rewards/tool_sum.py)
TOOL_SUM_VOCAB = "0123456789+"  # the tiny model's task_vocab for this task
CALL_MARKERS = (CALL_OPEN, CALL_CLOSE)  # added to the vocabulary as single tokens


def tool_sum_rows(*, size: int = 2000, val_size: int = 200, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows): ``size`` distinct sums a+b with 10 <= a, b <= 999."""
    if not 0 < val_size < size <= 990 * 990:
        raise DataError(f"tool sums: need 0 < val_size ({val_size}) < size ({size}) <= {990 * 990}")
    rng = np.random.default_rng([seed % (1 << 63), 46])
    picks = rng.choice(990 * 990, size=size, replace=False)
    pairs = [(10 + int(k) // 990, 10 + int(k) % 990) for k in picks]
    return _rows(pairs[val_size:], "train"), _rows(pairs[:val_size], "test")


def _rows(pairs: list[tuple[int, int]], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": TOOL_SUM,
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "agent_name": "tool_agent",
            "ability": "tool_use",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"split": split, "index": i, "expression": f"{a}+{b}"},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def correct_trajectory(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation a correct rollout of ``row`` renders: prompt, call, tool answer, answer."""
    expression, answer = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
    return [
        *row["prompt"],
        {"role": "assistant", "content": f"{CALL_OPEN}{expression}{CALL_CLOSE}"},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def write_tool_sums(out_dir: str | Path, *, size: int = 2000, val_size: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` (RL prompts), and ``sft.parquet`` and
    ``sft_val.parquet`` (their correct trajectories) under ``out_dir``; returns the RL files."""
    train, val = tool_sum_rows(size=size, val_size=val_size, seed=seed)
    out = Path(out_dir)
    write_prompt_file([{"messages": correct_trajectory(r)} for r in train], out / "sft.parquet")
    write_prompt_file([{"messages": correct_trajectory(r)} for r in val], out / "sft_val.parquet")
    return write_prompt_file(train, out / "train.parquet"), write_prompt_file(val, out / "val.parquet")
