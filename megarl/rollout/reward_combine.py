"""Scoring with reward.combine (or reward.judge): each component scored where it runs, then summed.

:class:`CombinedScorer` has the reward pool's ``score(...) -> ScoreResult``, so the rollout's
``Scorer`` uses either. Per call: the built-in rule scorers named in reward.combine run in one reward
pool (one task list, each sample once per rule component), reward.custom in a pool of its own,
reward.model in the reward model's pool (or its role, reward.model.placement disaggregated), the judge in one generate call of its engine
(megarl/rollout/judge.py). A sample's score is the weighted sum of its data source's components
(megarl/rewards/combine.py); each component's mean over the samples that use it is logged as
``reward/<component>``, the judge's failures as ``reward/judge_errors`` and ``reward/judge_timeouts``.
Every pool keeps its own failure counting and reward.max_failed_fraction, over its own samples.
A sample's ``pred`` and extras (``acc``: val/acc) come from one component, its reporter
(:func:`reporter`): the data source's own rule scorer when listed, else its first-listed component
other than the judge; the other components give only their scores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.reward_sections import CUSTOM_COMPONENT, JUDGE_COMPONENT, MODEL_COMPONENT
from megarl.config.sections import RewardConfig
from megarl.rewards import registry
from megarl.rewards.combine import OWN, weighted_sum, weights_of
from megarl.rewards.scorer import TRAINING_STOPS, RewardScorer, ScoreResult, remove_if_empty
from megarl.rollout.judge import Judge


@dataclass
class CombinedResult(ScoreResult):
    """A ScoreResult with the judge's failure counts (logged when a judge is configured)."""

    judge_errors: int = 0
    judge_timeouts: int = 0
    judged: bool = False

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        out = super().metrics(prefix)
        if self.judged:
            out[f"{prefix}judge_errors"] = float(self.judge_errors)
            out[f"{prefix}judge_timeouts"] = float(self.judge_timeouts)
        return out


def _pools(cfg: RewardConfig, model_role: bool = False) -> dict[str, RewardConfig]:
    """The reward pools a combined config needs, each with the one config its RewardScorer takes:
    rule scorers (no custom function, no model), reward.custom, reward.model (not with
    ``model_role``: the reward model's role scores it)."""
    bare: dict[str, Any] = {"model": None, "judge": None, "combine": {}}
    named_rules = any(n not in (CUSTOM_COMPONENT, MODEL_COMPONENT, JUDGE_COMPONENT) for p in cfg.combine.values() for n in p)
    pools = {}
    if cfg.custom is None or named_rules:
        pools["rules"] = cfg.model_copy(update={**bare, "custom": None})
    if cfg.custom is not None:
        pools[CUSTOM_COMPONENT] = cfg.model_copy(update=bare)
    if cfg.model is not None and not model_role:
        pools[MODEL_COMPONENT] = cfg.model_copy(update={**bare, "custom": None, "model": cfg.model})
    return pools


class CombinedScorer:
    """The reward pools and the judge of a reward.combine config; use as a context manager.
    ``model``: the reward model's role (megarl/rollout/reward_model_role.py), which then scores the
    ``model`` component in place of a reward pool; closed with the rest."""

    def __init__(self, cfg: RewardConfig, judge: Judge | None = None, *, start_method: str = "forkserver",
                 model: Any = None, log_path: str | Path | None = None, stops: str = TRAINING_STOPS) -> None:  # fmt: skip
        """``stops``: what a pool's RewardError says stops (RewardScorer's); ``log_path``: the reward
        functions' output (RewardScorer's), one file for every pool: this scorer owns it and removes
        it when empty after the last pool closed (a pool closing first would remove it under the others)."""
        self.cfg, self.judge = cfg, judge
        self.log_path = Path(log_path).absolute() if log_path is not None else None
        self._log_made = self.log_path is not None and not self.log_path.exists()
        self.pools: dict[str, Any] = {} if model is None else {MODEL_COMPONENT: model}  # RewardScorer, or the role
        try:
            for name, pool_cfg in _pools(cfg, model_role=model is not None).items():  # (one log file: lines appended)
                self.pools[name] = RewardScorer(pool_cfg, start_method=start_method, stops=stops, log_path=log_path,
                                                owns_log=False)  # fmt: skip
        except BaseException:
            self.close()
            raise

    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict | None] | None = None, prompts: Sequence[str] | None = None,
              raw_prompts: Sequence[Any] | None = None) -> CombinedResult:  # fmt: skip
        """RewardScorer.score's contract; ``raw_prompts`` (the prompts as the data holds them) is what
        the judge and a reward model's own chat template read, else ``prompts``."""
        n = len(solution_strs)
        infos = list(extra_infos) if extra_infos is not None else [None] * n
        weights = [weights_of(self.cfg, s) for s in data_sources]
        result = CombinedResult(scores=[0.0] * n, preds=[None] * n, judged=self.judge is not None)
        components: dict[str, list[float]] = {}
        entries = [(i, name) for i, parts in enumerate(weights) for name in parts]  # each sample once per component
        reporters = [reporter(self.cfg, source, parts) for source, parts in zip(data_sources, weights, strict=True)]
        for pool, picked in self._by_pool(entries).items():
            rows = [i for i, _ in picked]
            scorers = [None if name in (OWN, CUSTOM_COMPONENT, MODEL_COMPONENT) else name for _, name in picked]
            part = self.pools[pool].score(
                [data_sources[i] for i in rows], [solution_strs[i] for i in rows], [ground_truths[i] for i in rows],
                [infos[i] for i in rows], prompts=[prompts[i] for i in rows] if prompts is not None else None,
                scorers=scorers if pool == "rules" else None,
                raw_prompts=[raw_prompts[i] for i in rows] if raw_prompts else None,
            )  # fmt: skip
            self._merge(result, components, part, picked, reporters)
        judged = [i for i, parts in enumerate(weights) if JUDGE_COMPONENT in parts]
        if judged and self.judge is not None:
            said = raw_prompts if raw_prompts else prompts if prompts is not None else [""] * n
            verdict = self.judge.score([said[i] for i in judged], [solution_strs[i] for i in judged],
                                       [ground_truths[i] for i in judged], [data_sources[i] for i in judged])  # fmt: skip
            values = components.setdefault(JUDGE_COMPONENT, [math.nan] * n)
            for i, score in zip(judged, verdict.scores, strict=True):
                values[i] = score
            result.judge_errors, result.judge_timeouts = verdict.errors, verdict.timeouts
        result.scores = weighted_sum(weights, components)
        for name, values in components.items():
            if name != OWN:
                result.extra[name] = values
        return result

    def _by_pool(self, entries: list[tuple[int, str]]) -> dict[str, list[tuple[int, str]]]:
        out: dict[str, list[tuple[int, str]]] = {}
        for i, name in entries:
            if name == JUDGE_COMPONENT:
                continue
            own_pool = CUSTOM_COMPONENT if self.cfg.custom is not None else "rules"
            pool = own_pool if name == OWN else name if name in (CUSTOM_COMPONENT, MODEL_COMPONENT) else "rules"
            out.setdefault(pool, []).append((i, name))
        return out

    @staticmethod
    def _merge(result: CombinedResult, components: dict[str, list[float]], part: ScoreResult,
               picked: list[tuple[int, str]], reporters: list[str | None]) -> None:  # fmt: skip
        """One pool's scores into the components, its counts into ``result``, and its pred and extras
        for the samples whose reporter it is (a sample scored by two components would else keep
        whichever came last)."""
        n = len(reporters)
        result.errors += part.errors
        result.timeouts += part.timeouts
        for k, (i, name) in enumerate(picked):
            components.setdefault(name, [math.nan] * n)[i] = part.scores[k]
            if name != reporters[i]:
                continue
            if part.preds and part.preds[k] is not None:
                result.preds[i] = part.preds[k]
            for key, values in part.extra.items():
                if not math.isnan(values[k]):
                    result.extra.setdefault(key, [math.nan] * n)[i] = values[k]

    def close(self) -> None:
        try:
            for pool in self.pools.values():
                pool.close()
            if self.judge is not None:
                self.judge.close()
        finally:
            if self._log_made and self.log_path is not None:
                remove_if_empty(self.log_path)
                self._log_made = False

    def __enter__(self) -> CombinedScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def reporter(cfg: RewardConfig, data_source: str, parts: Iterable[str]) -> str | None:
    """The component whose pred and extras a sample of ``data_source`` reports: its own rule scorer
    when ``parts`` lists it, else the first-listed one other than the judge (None: only the judge)."""
    names = [name for name in parts if name != JUDGE_COMPONENT]
    try:
        own: str | None = registry.resolve(data_source, cfg.functions)
    except ValueError:  # a data source with no scorer of its own: reward.combine names them all
        own = None
    return own if own in names else (names[0] if names else None)
