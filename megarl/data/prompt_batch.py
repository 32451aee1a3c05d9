"""A step's prompts (PromptBatch): the hand-off from data to rollout.

``PromptBatch`` holds ``P`` prompts (token ids plus the metadata the reward functions need).
The rollout turns the engines' answers into a Batch (megarl/rollout/batching.py): the n
samples of prompt j get ``group_id = j`` and their own copy of the prompt's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptBatch:
    """``P`` prompts of one step (or of a validation pass), all lists aligned, length P."""

    prompt_ids: list[list[int]]  # token ids after templating and truncation, unpadded
    prompt_text: list[str]  # the rendered text the ids came from
    data_source: list[str]
    ground_truth: list[Any]
    extra_info: list[dict[str, Any]]
    index: list[int]  # the row of each prompt in its file
    file_index: list[int]  # which file (position in data.train_files / data.val_files)
    step: int = -1  # the RL step that drew this batch (-1: validation)
    # Optional, empty or length P: each prompt's agent loop (data column agent_name; "" = the
    # default) and its prompt as stored (a string or chat messages), for multi-turn loops.
    agent_name: list[str] = field(default_factory=list)
    raw_prompt: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("prompt_text", "data_source", "ground_truth", "extra_info", "index", "file_index"):
            assert len(getattr(self, name)) == n, (name, len(getattr(self, name)), n)
        for name in ("agent_name", "raw_prompt"):
            assert len(getattr(self, name)) in (0, n), (name, len(getattr(self, name)), n)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, rows: Sequence[int]) -> PromptBatch:
        """The prompts at ``rows``, metadata aligned (e.g. to cut validation into chunks)."""
        pick = list(rows)
        return PromptBatch(
            prompt_ids=[self.prompt_ids[i] for i in pick],
            prompt_text=[self.prompt_text[i] for i in pick],
            data_source=[self.data_source[i] for i in pick],
            ground_truth=[self.ground_truth[i] for i in pick],
            extra_info=[self.extra_info[i] for i in pick],
            index=[self.index[i] for i in pick],
            file_index=[self.file_index[i] for i in pick],
            step=self.step,
            agent_name=[self.agent_name[i] for i in pick] if self.agent_name else [],
            raw_prompt=[self.raw_prompt[i] for i in pick] if self.raw_prompt else [],
        )
