"""Turning engine outputs into the Batch the trainer works on, and responses into text.

The engines answer ``[p0s0 .. p0s(n-1), p1s0 ...]``; here those rows become one Batch with
every sample of prompt ``p`` carrying group id ``group_offset + p`` and that prompt's
metadata (``extra_info`` copied per sample: a reward function may annotate its own), prompts
left-padded and responses right-padded. Every generated token counts in the
loss (no tool or user turns in single-turn rollouts).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from megarl.data.batch import FINISH_REASONS, Batch
from megarl.data.routing_ids import unrouted_id
from megarl.engines.base import GenerationResult


def batch_from_generations(
    prompts: Sequence[Sequence[int]],
    results: Sequence[GenerationResult],
    n: int,
    *,
    group_offset: int = 0,
    data_source: Sequence[str] = (),
    ground_truth: Sequence[Any] = (),
    extra_info: Sequence[dict] = (),
    prompt_text: Sequence[str] = (),
    raw_prompt: Sequence[Any] = (),
) -> Batch:
    """One row per result; per-prompt metadata lists (length ``len(prompts)``) are repeated n times."""
    if len(results) != len(prompts) * n:
        raise ValueError(f"expected {len(prompts)} prompts x n={n} results, got {len(results)}")
    rows = [r.prompt_index for r in results]
    if rows != [p for p in range(len(prompts)) for _ in range(n)]:
        raise ValueError("engine results are not grouped by prompt as [p0s0 .. p0s(n-1), p1s0, ...]")
    b = len(results)
    p_len = max(len(p) for p in prompts)
    r_len = max(1, max(len(r.response_ids) for r in results))
    prompt_ids = torch.zeros(b, p_len, dtype=torch.long)
    prompt_mask = torch.zeros(b, p_len, dtype=torch.long)
    response_ids = torch.zeros(b, r_len, dtype=torch.long)
    logprobs = torch.zeros(b, r_len, dtype=torch.float32)
    for i, res in enumerate(results):
        prompt = prompts[res.prompt_index]
        prompt_ids[i, p_len - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        prompt_mask[i, p_len - len(prompt) :] = 1
        k = len(res.response_ids)
        if len(res.logprobs) != k:
            raise ValueError(f"sample {i}: {k} response tokens but {len(res.logprobs)} log-probs")
        if res.finish_reason not in FINISH_REASONS:
            raise ValueError(f"sample {i}: unknown finish reason {res.finish_reason!r}")
        response_ids[i, :k] = torch.as_tensor(res.response_ids, dtype=torch.long)
        logprobs[i, :k] = torch.as_tensor(res.logprobs, dtype=torch.float32)
    lengths = torch.tensor([len(r.response_ids) for r in results], dtype=torch.long)
    valid = (torch.arange(r_len)[None, :] < lengths[:, None]).float()
    routed_experts, routing_weights = _routing(prompts, results, p_len, r_len)
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_lengths=lengths,
        response_mask=valid,
        group_id=torch.tensor([group_offset + r.prompt_index for r in results], dtype=torch.long),
        data_source=_repeat(data_source, rows),
        ground_truth=_repeat(ground_truth, rows),
        extra_info=[copy.deepcopy(extra_info[p]) for p in rows] if len(extra_info) else [],  # each sample owns its dict
        prompt_text=_repeat(prompt_text, rows),
        raw_prompt=_repeat(raw_prompt, rows),
        finish_reason=[r.finish_reason for r in results],
        rollout_logprobs=logprobs * valid,
        routed_experts=routed_experts,
        routing_weights=routing_weights,
        token_versions=_token_versions(results, r_len),
    )


def _token_versions(results: Sequence[GenerationResult], r_len: int) -> torch.Tensor | None:
    """Each response token's weight version [B, R] long (0 on padding), when every result says."""
    if any(r.token_versions is None for r in results):
        return None
    out = torch.zeros(len(results), r_len, dtype=torch.long)
    for i, res in enumerate(results):
        assert res.token_versions is not None
        if len(res.token_versions) != len(res.response_ids):
            raise ValueError(f"sample {i}: {len(res.response_ids)} response tokens but {len(res.token_versions)} "
                             "token versions")  # fmt: skip
        out[i, : len(res.token_versions)] = torch.as_tensor(res.token_versions, dtype=torch.long)
    return out


def _routing(
    prompts: Sequence[Sequence[int]], results: Sequence[GenerationResult], p_len: int, r_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The results' routing laid out like ``Batch.sequences()``: ids [B, P+R, L, k] ("not routed" on
    padding) and weights [B, P+R, L, k] (0 on padding), in the engine's dtypes; None where the
    engines reported none."""
    reported = [r.routed_experts is not None for r in results]
    if not any(reported):
        return None, None
    if not all(reported):
        raise ValueError(f"engine results carry expert routing for {sum(reported)} of {len(results)} samples; "
                         "an engine that was asked for it (SamplingParams.return_routing) returned none")  # fmt: skip
    first = results[0].routed_experts
    assert first is not None
    ids = torch.full((len(results), p_len + r_len, *first.shape[1:]), unrouted_id(first.dtype), dtype=first.dtype)
    with_weights = all(r.routing_weights is not None for r in results)
    weights = torch.zeros(ids.shape, dtype=results[0].routing_weights.dtype) if with_weights else None  # type: ignore[union-attr]
    for i, res in enumerate(results):
        assert res.routed_experts is not None
        start, tokens = p_len - len(prompts[res.prompt_index]), len(prompts[res.prompt_index]) + len(res.response_ids)
        if res.routed_experts.shape[0] != tokens:
            raise ValueError(f"sample {i}: routing of {res.routed_experts.shape[0]} tokens for a prompt and response "
                             f"of {tokens}")  # fmt: skip
        ids[i, start : start + tokens] = res.routed_experts
        if weights is not None and res.routing_weights is not None:
            weights[i, start : start + tokens] = res.routing_weights
    return ids, weights


def _repeat(values: Sequence[Any], rows: list[int]) -> list[Any]:
    return [values[p] for p in rows] if len(values) else []


def response_texts(batch: Batch, tokenizer: Any, eos_token_ids: Sequence[int]) -> list[str]:
    """Each response decoded for scoring: a final EOS dropped, other special tokens kept.

    Keeping special tokens means a response that interleaves e.g. ``<|im_start|>`` with the
    answer does not read as the bare answer to the reward function.
    """
    eos = set(int(t) for t in eos_token_ids)
    texts = []
    for ids, n in zip(batch.response_ids.tolist(), batch.response_lengths.tolist()):
        ids = ids[:n]
        if ids and ids[-1] in eos:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return texts
