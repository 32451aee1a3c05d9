"""Controller side of generation: prompts -> scored Batch, whatever the engines are.

- ``WorkerEngines``: torch engines living in the policy ranks (one per DP replica); prompts are
  cut into contiguous shards, one per engine, so all n samples of a prompt go to one engine.
  The trainer wraps its engines, torch or SGLang, in megarl/memory/handover.py
  ``HandedOverEngines``, so that every generation runs in the memory hand-over's generate phase.
- ``Scorer``: decodes responses and scores them in the reward worker pool.
- ``Collector`` strategies: ``PlainCollector`` (one generation round) or
  ``DynamicSamplingCollector`` (DAPO: more rounds until enough groups have reward variance).
- ``Baseline`` strategies: none, or remax's greedy rollout per prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from megarl.algos.dapo import dynamic_sampling_filter, overlong_penalty, zero_var_group_frac
from megarl.config.algorithm_sections import OverlongConfig
from megarl.data.batch import Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import Engines, GenerationResult, SamplingParams
from megarl.engines.seeds import step_seed
from megarl.progress import PhaseTimer
from megarl.rollout.batching import batch_from_generations, response_texts
from megarl.rollout.generate import GenerateFn
from megarl.rollout.single_turn import generate_batch


class WorkerEngines:
    """Torch engines inside the policy ranks (one per DP replica, on its leader rank)."""

    def __init__(self, policy: Any):
        self.policy = policy  # megarl.actors.clients.PolicyClient
        layouts = policy.layouts()
        self.engine_ranks = [lay.rank for lay in sorted((x for x in layouts if x.leader), key=lambda x: x.dp_rank)]
        self.world = len(layouts)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        shards = _shards(len(prompts), len(self.engine_ranks))
        requests: list[Any] = [None] * self.world
        for rank, (start, stop) in zip(self.engine_ranks, shards):
            if stop > start:
                requests[rank] = ([list(p) for p in prompts[start:stop]], params.for_prompts(start, stop), start * params.n)
        answers = self.policy.generate(requests)
        results: list[GenerationResult] = []
        for rank, (start, stop) in zip(self.engine_ranks, shards):
            if stop > start:
                results += [dataclasses.replace(r, prompt_index=r.prompt_index + start) for r in answers[rank]]
        return results


def _shards(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous near-equal [start, stop) ranges."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class Scorer:
    """Decode the responses, score them in the reward pool, put the scores on the batch."""

    def __init__(self, reward_scorer: Any, tokenizer: Any, eos_token_ids: Sequence[int]):
        self.reward_scorer, self.tokenizer, self.eos = reward_scorer, tokenizer, list(eos_token_ids)
        # One batch at a time: an asynchronous run's producer thread and the loop's validation
        # share the reward pool, whose restarts are not thread-safe.
        self._lock = threading.Lock()

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        batch, result = self.score_result(batch)
        return batch, result.metrics()

    def score_result(self, batch: Batch) -> tuple[Batch, Any]:
        """The scored batch and the whole megarl.rewards.scorer.ScoreResult (extras, preds)."""
        texts = response_texts(batch, self.tokenizer, self.eos)
        with self._lock:
            result = self.reward_scorer.score(batch.data_source, texts, batch.ground_truth, batch.extra_info, prompts=batch.prompt_text,
                                              raw_prompts=batch.raw_prompt)  # fmt: skip
        scores = torch.tensor(result.scores, dtype=torch.float32)  # [B]
        return batch.replace(scores=scores), result

    def texts(self, batch: Batch) -> list[str]:
        return response_texts(batch, self.tokenizer, self.eos)


class Collector(Protocol):
    def collect(self, prompts: PromptBatch, params: SamplingParams, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]: ...


class PlainCollector:
    """One generation round (``generate``, rollout.generate_function), then scoring."""

    def __init__(self, engines: Engines, scorer: Scorer, generate: GenerateFn = generate_batch):
        self.engines, self.scorer, self.generate = engines, scorer, generate

    def collect(self, prompts: PromptBatch, params: SamplingParams, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        with timer.phase("generate"):
            batch = self.generate(self.engines, prompts, params)
        with timer.phase("reward"):
            return self.scorer.score(batch)


class DynamicSamplingCollector:
    """DAPO dynamic sampling: drop groups whose samples all scored the same, generate more.

    Round k draws ``prompts_per_step`` fresh prompts from the stream (k > 1) until enough groups
    with reward variance are collected or ``max_rounds`` is reached; then the batch is filled up
    with dropped groups to keep the step's size, and batch arithmetic, fixed. Those have zero
    advantage under group estimators, so they add no policy gradient, but their tokens still
    count in the token-mean denominator and in the entropy / KL terms (the update is scaled by
    the kept share, as in verl). Surplus groups are discarded, not carried over. Each round
    samples with its own seed, derived from the step's seed and the round.
    """

    def __init__(self, plain: PlainCollector, next_prompts: Any, max_rounds: int):
        self.plain = plain
        self.next_prompts, self.max_rounds = next_prompts, max_rounds

    def collect(self, prompts: PromptBatch, params: SamplingParams, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        wanted = len(prompts)
        kept: list[Batch] = []
        dropped: list[Batch] = []
        metrics: dict[str, float] = {}
        rounds = 0
        assert params.seed is not None  # the trainer seeds every step (Trainer.sampling): rounds get their own
        while rounds < self.max_rounds and sum(b.num_groups() for b in kept) < wanted:
            if rounds:
                prompts = self.next_prompts()
            round_params = dataclasses.replace(params, seed=step_seed(params.seed, rounds)) if rounds else params
            batch, round_metrics = self.plain.collect(prompts, params=round_params, timer=timer)
            metrics = add_counts(metrics, round_metrics)
            batch = batch.replace(group_id=batch.group_id + rounds * wanted)  # unique across rounds
            assert batch.scores is not None  # the plain collector scores every batch
            keep, _ = dynamic_sampling_filter(batch.scores, batch.group_id)
            kept.append(batch.select(keep))
            dropped.append(batch.select(~keep))
            rounds += 1
        pool = Batch.concat([b for b in kept + dropped if len(b)])
        batch = _first_groups(pool, wanted)
        metrics["dynamic_sampling/rounds"] = float(rounds)
        metrics["dynamic_sampling/kept_groups"] = float(min(wanted, sum(b.num_groups() for b in kept)))
        return batch, metrics


def add_counts(total: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    """Collection metrics over several rounds (or an asynchronous run's draws): error / timeout
    counts and phase seconds (``time/<phase>_s``) add up, means are the last round's."""
    out = dict(new)
    for key in ("reward/errors", "reward/timeouts"):
        out[key] = total.get(key, 0.0) + new.get(key, 0.0)
    for key in ("reward/judge_errors", "reward/judge_timeouts"):  # with reward.judge only
        if key in total or key in new:
            out[key] = total.get(key, 0.0) + new.get(key, 0.0)
    for key, value in total.items():
        if key.startswith("time/") and key.endswith("_s"):
            out[key] = value + new.get(key, 0.0)
    return out


def _first_groups(batch: Batch, groups: int) -> Batch:
    """The rows of the first ``groups`` distinct group ids, in order, renumbered 0..groups-1."""
    order = list(dict.fromkeys(batch.group_id.tolist()))[:groups]
    rank = {g: i for i, g in enumerate(order)}
    rows = [i for i, g in enumerate(batch.group_id.tolist()) if g in rank]
    picked = batch.select(rows)
    return picked.replace(group_id=torch.tensor([rank[g] for g in picked.group_id.tolist()], dtype=torch.long))


class Baseline(Protocol):
    def scores(self, batch: Batch, params: SamplingParams) -> torch.Tensor | None: ...


class NoBaseline:
    def scores(self, batch: Batch, params: SamplingParams) -> torch.Tensor | None:
        return None


class GreedyBaseline:
    """ReMax: each prompt's greedy response scored; [B] baseline, the group's value per sample.

    With DAPO overlong shaping (``overlong``: algorithm.overlong) the greedy response's score is
    shaped by its length as the samples' scores are (algos.step.advantage_step), as verl's reward
    manager shapes every batch it scores: an unshaped baseline would be too high by the penalty
    of a long greedy response, and every advantage of its group too low.
    """

    def __init__(self, engines: Engines, scorer: Scorer, overlong: OverlongConfig | None = None, max_new_tokens: int = 0):
        self.engines, self.scorer = engines, scorer
        self.overlong, self.max_new_tokens = overlong, max_new_tokens

    def scores(self, batch: Batch, params: SamplingParams) -> torch.Tensor:
        groups = list(dict.fromkeys(batch.group_id.tolist()))
        first_rows = [batch.group_id.tolist().index(g) for g in groups]
        heads = batch.select(first_rows)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(heads.prompt_ids, heads.prompt_mask)]
        greedy = dataclasses.replace(params, temperature=0.0, n=1, top_p=1.0, top_k=-1)
        results = self.engines.generate(prompts, greedy)
        greedy_batch = batch_from_generations(
            prompts, results, 1, data_source=heads.data_source, ground_truth=heads.ground_truth,
            extra_info=heads.extra_info, prompt_text=heads.prompt_text,
        )
        scored, _ = self.scorer.score(greedy_batch)
        assert scored.scores is not None  # what score() fills
        scores = scored.scores.to(torch.float32)  # [G]
        if self.overlong is not None:  # (length 0: no penalty)
            scores = scores + overlong_penalty(scored.response_lengths, self.max_new_tokens, self.overlong.length,
                                               self.overlong.penalty)  # fmt: skip
        per_group = dict(zip(groups, scores.tolist()))
        return torch.tensor([per_group[g] for g in batch.group_id.tolist()], dtype=torch.float32)


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """What every step reports about its samples."""
    scores = batch.scores if batch.scores is not None else torch.zeros(len(batch))
    lengths = batch.response_lengths.float()
    return {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(batch) > 1 else 0.0,
        "reward/zero_var_group_frac": zero_var_group_frac(scores, batch.group_id),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response/truncated_frac": sum(r == "length" for r in batch.finish_reason) / max(len(batch), 1),
        **_agent_metrics(batch),
    }


def _agent_metrics(batch: Batch) -> dict[str, float]:
    """Finish reasons beyond stop / length, and the agent loops' counts (megarl/rollout/agents/driver.py)."""
    out: dict[str, float] = {}
    for reason in sorted(set(batch.finish_reason) - {"stop", "length"}):
        out["response/finish_<reason>_frac".replace("<reason>", reason)] = batch.finish_reason.count(reason) / len(batch)
    counts = [e["agent"] for e in batch.extra_info if isinstance(e.get("agent"), dict)]
    if counts:
        out["agent/turns_mean"] = sum(c["turns"] for c in counts) / len(counts)
        out["agent/tool_calls_mean"] = sum(c["tool_calls"] for c in counts) / len(counts)
        out["agent/tool_failures_mean"] = sum(c["tool_failures"] for c in counts) / len(counts)
        out["agent/with_tool_call_frac"] = sum(c["tool_calls"] > c["tool_failures"] for c in counts) / len(counts)
    return out
