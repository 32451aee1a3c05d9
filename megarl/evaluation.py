"""Scored responses summarised per data source: what `megarl evaluate` prints and what RL
validation logs as ``val/*`` (one code path for both).

Each prompt has ``n`` scored responses. Per data source, averaged over its prompts:

- ``reward/mean``: the mean score of the responses (verl's ``mean@n``);
- ``pass@k``: the chance that at least one of ``k`` responses drawn without replacement from
  the prompt's ``n`` passes, by the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` (Chen et
  al. 2021, c = passing responses); a response passes when its reward function's ``acc`` is
  true, or, for a function that returns no ``acc``, when its score >= ``pass_threshold``;
- ``best@k`` / ``worst@k`` (k >= 2; at k = 1 they are the mean): the expected highest /
  lowest score of ``k`` responses drawn with replacement (what verl's validation estimates by
  bootstrap; computed exactly here);
- ``maj@k`` (k >= 2): the score of the majority answer among ``k`` responses drawn with replacement,
  for a data source whose reward function returns a ``pred`` (its extracted answer, verl's
  convention): 1000 bootstrap draws with a fixed seed, the most common ``pred`` wins (ties: the
  first drawn), and its first drawn response's score counts. A response without a ``pred`` (an
  answer the function could not extract) votes for "no answer", as in verl; ``all`` has maj@k
  when every data source has it;
- ``response_length/mean|min|max`` (tokens) and ``truncated_frac`` (finish reason ``length``);
- with reward.combine (:func:`add_components`), ``reward/<component>``: each component's mean over
  the responses that use it (over responses, not prompts: as training logs ``reward/<component>``).

``all`` holds the same over every prompt (a data source named ``all`` would share its row).
Prompts with different numbers of responses: a number at k is over the prompts with at least k
(`megarl evaluate` says which k left rows out: :func:`ragged_note`).
Torch-free: the CLI imports it without torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ALL = "all"
MAJORITY_DRAWS = 1000  # bootstrap draws of maj@k (verl uses 1000)
MAJORITY_SEED = 42


class EvaluationError(ValueError):
    """A k larger than the responses per prompt, or responses that cannot be summarised."""


@dataclass(frozen=True)
class ScoredResponse:
    """One scored response: which prompt it answers, its score and what the engine reported."""

    data_source: str
    prompt: int  # responses of the same prompt share this key
    score: float
    length: int  # response tokens
    finish_reason: str  # stop | length | abort
    passed: bool
    pred: str | None = None  # the reward function's extracted answer (maj@k), if it gives one


def scored_responses(data_source: Sequence[str], prompts: Sequence[int], scores: Sequence[float], lengths: Sequence[int],
                     finish_reasons: Sequence[str], *, pass_threshold: float, acc: Sequence[float] | None = None,
                     preds: Sequence[str | None] | None = None) -> list[ScoredResponse]:  # fmt: skip
    """Aligned per-response columns as ScoredResponses. ``acc``: the reward functions' ``acc``
    values (NaN where a function gave none): where given, it decides ``passed``."""
    out = []
    for i, score in enumerate(scores):
        given = acc is not None and not math.isnan(acc[i])
        passed = bool(acc[i]) if given else score >= pass_threshold  # type: ignore[index]
        out.append(ScoredResponse(data_source[i], int(prompts[i]), float(score), int(lengths[i]), finish_reasons[i],
                                  passed, preds[i] if preds else None))  # fmt: skip
    return out


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself (verl's sizes for best@k / maj@k)."""
    ks, k = [1], 2
    while k < n:
        ks.append(k)
        k *= 2
    return sorted({*ks, n})


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` passing responses out of ``n`` (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise EvaluationError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k), as a product (no huge binomials)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def expected_best(scores: Sequence[float], k: int) -> float:
    """E[max of k scores drawn with replacement]: sorted ascending, score i is the max with
    probability ((i+1)/n)^k - (i/n)^k."""
    ordered, n = sorted(scores), len(scores)
    return sum(s * (((i + 1) / n) ** k - (i / n) ** k) for i, s in enumerate(ordered))


def expected_worst(scores: Sequence[float], k: int) -> float:
    return -expected_best([-s for s in scores], k)


def majority_score(scores: Sequence[float], preds: Sequence[str | None], k: int, rng: np.random.Generator) -> float:
    """maj@k of one prompt by bootstrap (see the module docstring), vectorised over the draws;
    None (no pred) is an answer of its own."""
    ids = {pred: i for i, pred in enumerate(dict.fromkeys(preds))}
    codes = np.asarray([ids[pred] for pred in preds])  # [n] pred ids
    draws = rng.integers(len(scores), size=(MAJORITY_DRAWS, k))  # [D, k] response indices
    drawn = codes[draws]  # [D, k]
    counts = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)  # [D, k] votes of each drawn answer
    # The winner is the most voted answer; among ties, the one drawn first, and the score counted
    # is that of its first drawn response: the first position holding a most-voted answer.
    first = (counts == counts.max(-1, keepdims=True)).argmax(-1)  # [D]
    return float(np.asarray(scores, dtype=np.float64)[draws[np.arange(MAJORITY_DRAWS), first]].mean())


def greedy_copies_note(n: int) -> str:
    """What ``n`` > 1 greedy responses of one prompt amount to (`megarl plan` says it of greedy
    validation, `megarl generate` of --temperature 0), the fix left to the caller's knobs."""
    return (f"{n} greedy responses of one prompt are all the same one, so pass@k, best@k and maj@k equal pass@1 "
            f"at {n} times the cost")


def threshold_problem(value: float, reward: object) -> str | None:
    """Why a pass threshold cannot work with ``reward`` (a RewardConfig), or None. A response
    passes when its score is at least the threshold; the built-in functions score from 0 to 1, so
    above 1 none could pass and at 0 or below all would (a custom function's or a reward model's
    scores have no such range). The message starts with the value, for the caller to name it."""
    if not math.isfinite(value):
        return f"({value}) must be a finite number, e.g. 1 (a full score)"
    if getattr(reward, "custom", None) is None and getattr(reward, "model", None) is None and not 0 < value <= 1:
        outcome = "no response could pass" if value > 1 else "every response would pass"
        return (f"({value:g}) must be in (0, 1]: the built-in reward functions score from 0 to 1, so {outcome}; "
                "e.g. 1 (a full score) or 0.5")
    return None


def check_ks(ks: Sequence[int], n: int, where: str = "k") -> None:
    """Every k must be in 1..n (n: the most responses any prompt has)."""
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise EvaluationError(f"{where} {bad[0]} is not in 1..{n}: the prompt with the most responses has {n}; "
                              f"use k <= {n}, or generate more responses (--n)")  # fmt: skip


def ragged_note(counts: Sequence[int], ks: Sequence[int] | None = None) -> str | None:
    """What a summary of prompts with ``counts`` responses each (different numbers) leaves out:
    each k is taken over the prompts with at least k responses only. None when every prompt has
    as many (or no k leaves one out)."""
    if not counts or min(counts) == max(counts):
        return None
    ks = default_ks(max(counts)) if ks is None else sorted(set(ks))
    partial = [(k, sum(c >= k for c in counts)) for k in ks if k > min(counts)]
    if not partial:
        return None
    over = ", ".join(f"k={k}: {rows}" for k, rows in partial)
    return (f"the rows have {min(counts)} to {max(counts)} responses each: a k above {min(counts)} is taken over the rows "
            f"with at least k responses only ({over} of the {len(counts)} rows); generate the same number for every row "
            "(megarl generate --n) to compare every k over all of them")  # fmt: skip


def summarize(responses: Sequence[ScoredResponse], ks: Sequence[int] | None = None) -> dict[str, dict[str, float]]:
    """Per data source (and ``all``): the numbers of the module docstring. ``ks`` None: 1, 2,
    4, ... up to the most responses any prompt has; a number at k is the mean over the prompts
    with at least k responses (all of them when every prompt has as many: :func:`ragged_note`)."""
    if not responses:
        raise EvaluationError("no responses to evaluate")
    groups: dict[tuple[str, int], list[ScoredResponse]] = defaultdict(list)
    for r in responses:
        groups[(r.data_source, r.prompt)].append(r)
    n = max(len(g) for g in groups.values())
    ks = default_ks(n) if ks is None else sorted(set(ks))
    check_ks(ks, n)
    voting = {r.data_source for r in responses if r.pred is not None}  # the sources whose function gives preds
    # Each prompt's values once; a source's number is the mean over its prompts, ``all``'s over every prompt.
    per_prompt = {key: _prompt_values(group, ks, key[0] in voting, key[1]) for key, group in groups.items()}
    by_source: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key in groups:
        by_source[key[0]].append(key)
        by_source[ALL].append(key)
    return {source: _summary([groups[k] for k in keys], [per_prompt[k] for k in keys])
            for source, keys in sorted(by_source.items(), key=lambda x: x[0] != ALL)}  # fmt: skip


def _prompt_values(group: list[ScoredResponse], ks: Sequence[int], with_preds: bool, prompt: int) -> dict[str, float]:
    scores = [r.score for r in group]
    out = {"reward/mean": _mean(scores)}
    ks = [k for k in ks if k <= len(group)]  # a prompt with fewer responses has no number at k
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(len(group), sum(r.passed for r in group), k)
    drawn = [k for k in ks if k > 1]  # of one response, best, worst and majority are its mean score
    for k in drawn:
        out[f"best@{k}"] = expected_best(scores, k)
    for k in drawn:
        out[f"worst@{k}"] = expected_worst(scores, k)
    rng = np.random.default_rng([MAJORITY_SEED, prompt])  # the same draws whatever else is evaluated
    for k in drawn if with_preds else []:
        preds = [None if r.pred is None else str(r.pred) for r in group]  # (a function may give a number or a list)
        out[f"maj@{k}"] = majority_score(scores, preds, k, rng)
    return out


def _summary(prompts: list[list[ScoredResponse]], values: list[dict[str, float]]) -> dict[str, float]:
    flat = [r for group in prompts for r in group]
    out: dict[str, float] = {"prompts": len(prompts), "responses": len(flat)}
    # A number at k of every prompt with k responses or more only: maj@k of all when some source
    # has no preds would be of a part. Names in the order of the prompt with the most responses.
    fullest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    for name in values[fullest]:
        counted = [v for group, v in zip(prompts, values, strict=True) if len(group) >= _k_of(name)]
        if all(name in v for v in counted):
            out[name] = _mean(v[name] for v in counted)
    lengths = [r.length for r in flat]
    out["response_length/mean"] = _mean(lengths)
    out["response_length/min"] = float(min(lengths))
    out["response_length/max"] = float(max(lengths))
    out["truncated_frac"] = _mean(float(r.finish_reason == "length") for r in flat)
    return out


def _k_of(name: str) -> int:
    """The k of ``pass@k`` (best@k, ...); 1 for a number of every response (reward/mean)."""
    return int(name.rsplit("@", 1)[1]) if "@" in name else 1


def _mean(values: object) -> float:
    items = list(values)  # type: ignore[call-overload]
    return float(sum(items) / len(items)) if items else math.nan


def add_components(summary: dict[str, dict[str, float]], data_sources: Sequence[str],
                   components: Mapping[str, Sequence[float]]) -> None:  # fmt: skip
    """reward.combine's components into ``summary`` (of :func:`summarize`), as training logs them:
    ``reward/<component>``, per data source and ``all``, the mean over the responses that use the
    component (``components``: name -> one value per response, NaN where a response does not)."""
    for source, values in summary.items():
        for name, scores in components.items():
            used = [v for s, v in zip(data_sources, scores, strict=True) if (source == ALL or s == source) and not math.isnan(v)]
            if used:
                values[f"reward/{name}"] = _mean(used)


def as_metrics(summary: dict[str, dict[str, float]], prefix: str = "val/") -> dict[str, float]:
    """Flat metric names: ``val/pass@1`` for all sources, ``val/<source>/pass@1`` for one
    (counts of prompts and responses are left to the summary)."""
    out: dict[str, float] = {}
    for source, values in summary.items():
        head = prefix if source == ALL else f"{prefix}{source}/"
        out |= {f"{head}{name}": v for name, v in values.items() if name not in ("prompts", "responses")}
    return out
