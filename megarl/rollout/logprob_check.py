"""The post-sync check: engine and trainer log-probs of a few fixed sequences must agree.

After a weight push, the engine scores a handful of fixed (prompt, response) token sequences
(teacher-forced, ``engine.score``) and the trainer computes its log-probs of the same tokens at
the same temperature (``policy.compute_logprobs``). The mean |engine - trainer| over response
tokens is reported as ``weight_sync/logprob_diff``; above ``rollout.weight_sync.max_logprob_diff``
the sync is refused with :class:`LogprobMismatchError` (a silent mis-conversion or a partial
push shows up here, before it poisons training).

This module only builds the probe, collects the engine side and compares; calling the trainer
is the caller's job (it is a collective over the policy workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from megarl.data.batch import Batch


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the log-probs of the probe sequences after a sync."""


class ScoringEngine(Protocol):
    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperature: float
    ) -> list[list[float]]: ...


def probe_sequences(
    vocab_size: int, *, num: int = 4, prompt_len: int = 8, response_len: int = 8, seed: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """``num`` fixed random (prompt, response) id lists; prompt lengths vary to exercise padding."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(num):
        p_len = max(1, prompt_len - i % 3)
        prompts.append(torch.randint(0, vocab_size, (p_len,), generator=gen).tolist())
        responses.append(torch.randint(0, vocab_size, (response_len,), generator=gen).tolist())
    return prompts, responses


def probe_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int = 0) -> Batch:
    """The probe as a :class:`Batch` (left-padded prompts, right-padded responses) for the trainer."""
    b = len(prompts)
    p_width = max(len(p) for p in prompts)
    r_width = max(len(r) for r in responses)
    prompt_ids = torch.full((b, p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p_width), dtype=torch.long)
    response_ids = torch.full((b, r_width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, r_width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, p_width - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, p_width - len(p) :] = 1
        response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1.0
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.long),
        response_mask=response_mask,
        group_id=torch.arange(b, dtype=torch.long),
    )


def engine_logprobs(engine: ScoringEngine, batch: Batch, temperature: float) -> torch.Tensor:
    """The engine's teacher-forced log-probs of ``batch``'s responses, ``[B, R]`` (0 at padding)."""
    prompts = [row[m.bool()].tolist() for row, m in zip(batch.prompt_ids, batch.prompt_mask, strict=True)]
    lengths = batch.response_lengths.tolist()
    responses = [row[:n].tolist() for row, n in zip(batch.response_ids, lengths, strict=True)]
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for i, lps in enumerate(engine.score(prompts, responses, temperature)):
        out[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return out


def compare_logprobs(
    engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor, max_diff: float
) -> dict[str, float]:
    """Mean / max |engine - trainer| over ``mask`` (all ``[B, R]``); raises above ``max_diff``."""
    if engine_lp.shape != trainer_lp.shape:
        raise ValueError(f"engine log-probs {tuple(engine_lp.shape)} vs trainer {tuple(trainer_lp.shape)}")
    valid = mask.bool()
    diff = (engine_lp.float() - trainer_lp.float().cpu()).abs()[valid]
    mean, worst = float(diff.mean()), float(diff.max())
    if not mean <= max_diff:  # also catches NaN
        raise LogprobMismatchError(
            f"after the weight sync, engine and trainer log-probs differ by {mean:.4g} on average "
            f"(max {worst:.4g}) over {int(valid.sum())} probe tokens, above "
            f"rollout.weight_sync.max_logprob_diff ({max_diff}); the engine did not receive the "
            "trainer's weights as the trainer uses them (bridge conversion, dtype or a partial push)"
        )
    return {"weight_sync/logprob_diff": mean, "weight_sync/logprob_diff_max": worst}


class TrainerLogprobs(Protocol):
    def compute_logprobs(self, batch: Batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def check_after_sync(
    policy: TrainerLogprobs, engine: ScoringEngine | None, batch: Batch, temperature: float, max_diff: float
) -> dict[str, float]:
    """Run on EVERY policy rank right after a push (``compute_logprobs`` is collective).

    Ranks holding an engine (``engine`` not None) compare and return the metrics (or raise
    :class:`LogprobMismatchError`); the others return ``{}``.
    """
    trainer_lp, _ = policy.compute_logprobs(batch, temperature)
    if engine is None:
        return {}
    return compare_logprobs(engine_logprobs(engine, batch, temperature), trainer_lp, batch.response_mask, max_diff)
