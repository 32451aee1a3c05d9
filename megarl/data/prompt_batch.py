"""A step's prompts (PromptBatch) and their expansion into rollout samples (RolloutPrompts).

The hand-off from data to rollout: ``PromptBatch`` holds ``P`` prompts (token ids plus the
metadata the reward functions need); :func:`expand_for_rollout` turns it into what the engine
and the Batch need for ``n`` samples per prompt. Group ids are the prompt's position in the
step, ``0 .. P-1``: sample ``j * n + k`` (the k-th sample of prompt j, the order
``RolloutEngine.generate`` returns) gets ``group_id = j``, so ids are unique within a step and
the n samples of one prompt share one. Nothing here builds a Batch (the trainer does, from the
engine's results) or pads responses.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


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

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("prompt_text", "data_source", "ground_truth", "extra_info", "index", "file_index"):
            assert len(getattr(self, name)) == n, (name, len(getattr(self, name)), n)

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
        )


@dataclass(frozen=True)
class RolloutPrompts:
    """A PromptBatch expanded to ``P * n`` samples (see the module docstring for the order)."""

    prompt_ids: list[list[int]]  # [P] unique prompts: pass these with SamplingParams(n=n)
    n: int
    group_id: torch.Tensor  # [P*n] long, = sample // n
    data_source: list[str]  # [P*n]
    ground_truth: list[Any]  # [P*n]
    extra_info: list[dict[str, Any]]  # [P*n], a copy per sample (a reward may annotate its own)
    prompt_text: list[str]  # [P*n]

    def __len__(self) -> int:
        return len(self.prompt_ids) * self.n

    def sample_prompt_ids(self) -> list[list[int]]:
        """[P*n] the prompt of every sample (the same list object for the n samples of a prompt)."""
        return [ids for ids in self.prompt_ids for _ in range(self.n)]

    def padded_prompts(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompt_ids [P*n, L]`` left-padded with ``pad_id`` and ``prompt_mask [P*n, L]`` (1 = real),
        where L is the longest prompt: the Batch's prompt fields."""
        return left_pad(self.sample_prompt_ids(), pad_id)


def expand_for_rollout(prompts: PromptBatch, n: int) -> RolloutPrompts:
    """Repeat every prompt's metadata ``n`` times and give the samples of prompt j ``group_id`` j."""
    if n < 1:
        raise ValueError(f"rollout.n must be >= 1, got {n}")

    def rep(values: list[Any]) -> list[Any]:
        return [v for v in values for _ in range(n)]

    return RolloutPrompts(
        prompt_ids=list(prompts.prompt_ids),
        n=n,
        group_id=torch.arange(len(prompts), dtype=torch.long).repeat_interleave(n),  # [P*n]
        data_source=rep(prompts.data_source),
        ground_truth=rep(prompts.ground_truth),
        extra_info=[copy.deepcopy(e) for e in prompts.extra_info for _ in range(n)],
        prompt_text=rep(prompts.prompt_text),
    )


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows to the longest: ``ids [B, L]`` long and ``mask [B, L]`` long (1 = real)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask
