"""Controller side of the model work: each phase of the RL step as a small strategy object.

Which implementation a phase gets is decided once, when the trainer is built (e.g. no critic
-> ``Skip``), so the step itself has no feature ``if``s. Worker groups are called on every
rank; only rank 0 answers (see megarl/actors/policy_rank.py).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.algos.advantages import compute_advantages, reward_kl, token_rewards_from_scores
from megarl.algos.dapo import overlong_penalty
from megarl.algos.kl import make_kl_controller
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch


def _rank0(results: list[Any]) -> Any:
    return results[0]


def _prefixed(prefix: str, metrics: dict[str, float] | None) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in (metrics or {}).items()}


class Skip:
    """A phase that is off in this configuration."""

    def __call__(self, batch: Batch, *args: Any) -> Batch:
        return batch

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        return {}


class OldLogprobs:
    """The policy's log-probs before the update (needed off-policy: several epochs or mini-batches)."""

    def __init__(self, group: Any, temperature: float):
        self.group, self.temperature = group, temperature

    def __call__(self, batch: Batch) -> Batch:
        logprobs, _ = _rank0(self.group.call("compute_logprobs", batch, self.temperature))
        return batch.replace(old_logprobs=logprobs * batch.response_mask)


class ReferenceLogprobs:
    def __init__(self, group: Any, temperature: float):
        self.group, self.temperature = group, temperature

    def __call__(self, batch: Batch) -> Batch:
        logprobs = _rank0(self.group.call("compute_ref_logprobs", batch, self.temperature))
        return batch.replace(ref_logprobs=logprobs * batch.response_mask)


class CriticPhase:
    """Values before the update, and the critic's own update."""

    def __init__(self, group: Any):
        self.group = group

    def __call__(self, batch: Batch) -> Batch:
        values = _rank0(self.group.call("compute_values", batch))
        return batch.replace(values=values * batch.response_mask)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        return _prefixed("critic", _rank0(self.group.call("update", batch)))


class PolicyUpdate:
    """The policy's update; skipped while the critic warms up (PPO)."""

    def __init__(self, group: Any, temperature: float, warmup_steps: int):
        self.group, self.temperature, self.warmup_steps = group, temperature, warmup_steps

    def update(self, batch: Batch, step: int, kl_coef: float | None = None) -> dict[str, float]:
        if step <= self.warmup_steps:
            return {}
        metrics = _rank0(self.group.call("update", batch, self.temperature, kl_coef))
        out = _prefixed("actor", metrics)
        # The names the run log promises (see the README's metrics table).
        out["actor/clip_frac"] = out.get("actor/pg_clipfrac", 0.0)
        out["actor/kl"] = out.get("actor/kl", float("nan"))  # NaN (null in the log) without a reference
        if "actor/logprob_mismatch" in out:
            out["rollout/logprob_mismatch"] = out["actor/logprob_mismatch"]
        return out


class Advantages:
    """Scores -> token rewards (overlong shaping, KL in the reward) -> the estimator."""

    def __init__(self, cfg: MegaRLConfig):
        self.cfg = cfg.algorithm
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self.kl_controller = make_kl_controller(cfg.algorithm.kl)

    def __call__(self, batch: Batch, baseline: torch.Tensor | None) -> tuple[Batch, dict[str, float]]:
        ov = self.cfg.overlong
        penalty = overlong_penalty(batch.response_lengths, self.max_new_tokens, ov.length, ov.penalty)  # [B]
        scores = batch.scores + penalty
        metrics = {"reward/overlong_penalty_mean": float(penalty.mean())} if ov.length else {}
        kl, coef = None, 0.0
        if self.cfg.kl.use_in_reward:
            kl, kl_mean = reward_kl(batch, self.cfg.kl)
            coef = self.kl_controller.value
            metrics |= {"reward/kl": float(kl_mean), "reward/kl_coef": coef}
            self.kl_controller.update(float(kl_mean), len(batch))
        rewards = token_rewards_from_scores(scores, batch.response_lengths, batch.response_mask, kl, coef)
        batch = compute_advantages(batch.replace(token_rewards=rewards), self.cfg, baseline)
        valid = batch.response_mask.bool()
        metrics["advantages/mean"] = float(batch.advantages[valid].mean()) if valid.any() else 0.0
        return batch, metrics


class WeightPush:
    """Policy -> engines after each update, then the engine/trainer log-prob check."""

    def __init__(self, group: Any, temperature: float, check: bool):
        self.group, self.temperature, self.check = group, temperature, check

    def __call__(self, version: int) -> dict[str, float]:
        metrics = dict(_rank0(self.group.call("push_weights", version)))
        if self.check:
            metrics |= _rank0(self.group.call("check_logprobs", self.temperature))
        return metrics
