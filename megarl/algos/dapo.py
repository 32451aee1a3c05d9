"""DAPO's data-side pieces as pure functions: dynamic sampling filter and overlong shaping.

- ``dynamic_sampling_filter``: drop the groups whose scores are all equal (they carry no
  group-relative signal); groups of one are kept, as verl does (there is nothing to compare).
- ``overlong_penalty``: a linear length penalty over the last ``length`` tokens before
  ``max_new_tokens`` (0 up to ``max_new_tokens - length``, ``-penalty`` at the limit), added to
  the scores before the advantages.
- ``zero_var_group_frac``: the metric of how much of a step dynamic sampling would drop.

What is left out on purpose: the generation loop that draws more prompts until the batch is
full (the trainer's), and any state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algos.advantages import group_stats


@dataclass(frozen=True)
class FilterCounts:
    kept_groups: int
    dropped_groups: int
    kept_samples: int
    dropped_samples: int


def dynamic_sampling_filter(
    scores: torch.Tensor, group_id: torch.Tensor
) -> tuple[torch.Tensor, FilterCounts]:
    """Bool keep mask ``[B]`` dropping every group (size >= 2) whose scores are all equal."""
    st = group_stats(scores.to(torch.float32), group_id)
    dropped_group = st.constant & (st.count > 1)  # [G]
    keep = ~dropped_group[st.index]  # [B]
    n_drop_groups = int(dropped_group.sum())
    n_keep = int(keep.sum())
    counts = FilterCounts(
        kept_groups=int(st.count.numel()) - n_drop_groups,
        dropped_groups=n_drop_groups,
        kept_samples=n_keep,
        dropped_samples=int(keep.numel()) - n_keep,
    )
    return keep, counts


def zero_var_group_frac(scores: torch.Tensor, group_id: torch.Tensor) -> float:
    """Fraction of groups of size >= 2 whose scores are all equal (0.0 if there are none)."""
    st = group_stats(scores.to(torch.float32), group_id)
    multi = st.count > 1
    n = int(multi.sum())
    return float((st.constant & multi).sum()) / n if n else 0.0


def overlong_penalty(
    response_lengths: torch.Tensor, max_new_tokens: int, length: int, penalty: float
) -> torch.Tensor:
    """[B] the (non-positive) reward added for long responses; all zeros when ``length`` is 0.

    ``-penalty * (len - (max_new_tokens - length)) / length`` clamped to [-penalty, 0].
    """
    if length <= 0:
        return torch.zeros(
            response_lengths.shape, dtype=torch.float32, device=response_lengths.device
        )
    if length > max_new_tokens:
        raise ValueError(
            f"algorithm.overlong.length ({length}) must not exceed rollout.sampling.max_new_tokens ({max_new_tokens})"
        )
    excess = response_lengths.to(torch.float32) - (max_new_tokens - length)
    return (-penalty * excess / length).clamp(min=-penalty, max=0.0)
