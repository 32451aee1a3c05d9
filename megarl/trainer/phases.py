"""Controller side of the model work: each phase of the RL step as a small strategy object.

Which implementation a phase gets is decided once, when the trainer is built (e.g. no critic
-> ``Skip``), so the step itself has no feature ``if``s. Worker groups are called on every
rank; only rank 0 answers (see megarl/actors/policy_rank.py).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.algos.kl import make_kl_controller
from megarl.algos.step import advantage_step
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.rollout.collect import NoHandover


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

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        if step <= self.warmup_steps:
            return {}
        metrics = _rank0(self.group.call("update", batch, self.temperature))
        out = _prefixed("actor", metrics)
        # The names the run log promises (see the README's metrics table).
        out["actor/clip_frac"] = out.get("actor/pg_clipfrac", 0.0)
        out["actor/kl"] = out.get("actor/kl", float("nan"))  # NaN (null in the log) without a reference
        if "actor/logprob_mismatch" in out:
            out["rollout/logprob_mismatch"] = out["actor/logprob_mismatch"]
        return out


class Advantages:
    """Scores -> token rewards (overlong shaping, KL in the reward) -> the estimator.

    Holds the KL controller (checkpointed by the trainer); the work is ``algos.advantage_step``.
    """

    NAMES = {"reward_kl": "reward/kl", "kl_coef": "reward/kl_coef", "overlong_penalty_mean": "reward/overlong_penalty_mean",
             "advantage_mean": "advantages/mean", "return_mean": "advantages/return_mean"}

    def __init__(self, cfg: MegaRLConfig):
        self.cfg = cfg.algorithm
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self.kl_controller = make_kl_controller(cfg.algorithm.kl)

    def __call__(self, batch: Batch, baseline: torch.Tensor | None) -> tuple[Batch, dict[str, float]]:
        batch, metrics = advantage_step(batch, self.cfg, self.kl_controller, self.max_new_tokens, baseline)
        return batch, {self.NAMES[k]: v for k, v in metrics.items() if k in self.NAMES}


class WeightPush:
    """Policy -> engines after each update, then the engine/trainer log-prob check.

    ``handover`` (megarl.rollout.collect.Handover) runs before and after the push: e.g.
    colocated SGLang resumes its weights' memory first, restarts dead engines."""

    def __init__(self, group: Any, temperature: float, check: bool, handover: Any = None):
        self.group, self.temperature, self.check = group, temperature, check
        self.handover = handover if handover is not None else NoHandover()

    def __call__(self, version: int) -> dict[str, float]:
        self.handover.before_push(version)
        metrics = dict(_rank0(self.group.call("push_weights", version)))
        self.handover.after_push(version)
        if self.check:
            # Trainer side first, while the policy holds its device memory; then the engines
            # score, after the hand-over made room for them (colocated SGLang: policy offloaded).
            self.group.call("probe_trainer_logprobs", self.temperature)
            with self.handover.scoring():
                metrics |= _rank0(self.group.call("compare_probe_logprobs"))
        return metrics
