"""reward.combine: a data source's score as a weighted sum of named components.

A component is a built-in rule scorer (registry.SCORERS, by name), ``custom`` (reward.custom),
``model`` (reward.model) or ``judge`` (reward.judge). A data source reward.combine does not list
is scored as without it: by reward.model when set, else by its own rule scorer or reward.custom
(its one component, :data:`OWN`, weight 1). What scores each component (the reward workers, the
judge's engine) is megarl/rollout/reward_combine.py's; this module only names and sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import megarl.rewards.registry as registry
from megarl.config.reward_sections import CUSTOM_COMPONENT, JUDGE_COMPONENT, MODEL_COMPONENT
from megarl.config.sections import RewardConfig

OWN = ""  # the component of an unlisted data source: its rule scorer, reward.custom or reward.model


def component_names(cfg: RewardConfig) -> list[str]:
    """The names reward.combine may use with this config."""
    names = sorted(registry.SCORERS)
    names += [CUSTOM_COMPONENT] if cfg.custom is not None else []
    names += [MODEL_COMPONENT] if cfg.model is not None else []
    return names + ([JUDGE_COMPONENT] if cfg.judge is not None else [])


def component_problems(cfg: RewardConfig) -> list[str]:
    """reward.combine's components that name nothing this config scores with: one line each, with the fix."""
    known = component_names(cfg)
    problems = []
    for source, parts in cfg.combine.items():
        for name in parts:
            if name not in known:
                problems.append(f"reward.combine[{source!r}] names the component {name!r}, which is no built-in scorer "
                                f"and no configured section; use one of {', '.join(known)}")  # fmt: skip
    return problems


def weights_of(cfg: RewardConfig, data_source: str) -> Mapping[str, float]:
    """The components and weights that score a sample of ``data_source``."""
    if data_source in cfg.combine:
        return cfg.combine[data_source]
    return {MODEL_COMPONENT if cfg.model is not None else OWN: 1.0}


def weighted_sum(weights: Sequence[Mapping[str, float]], components: Mapping[str, Sequence[float]]) -> list[float]:
    """Each sample's score: sum of weight x component score over its components (``components``:
    name -> one score per sample, NaN where that sample does not use it)."""
    out = []
    for i, parts in enumerate(weights):
        total = 0.0
        for name, weight in parts.items():
            value = components[name][i]
            assert not math.isnan(value), (name, i)  # every component a sample uses was scored for it
            total += weight * value
        out.append(total)
    return out


def component_scores(cfg: RewardConfig, extra: Mapping[str, Sequence[float]]) -> dict[str, Sequence[float]]:
    """The reward.combine components among a score result's extras (name -> one value per sample,
    NaN where a sample does not use it), by name."""
    names = {name for parts in cfg.combine.values() for name in parts} - {OWN}
    return {name: extra[name] for name in sorted(names) if name in extra}
