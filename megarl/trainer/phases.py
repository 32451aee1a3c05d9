"""Controller side of the model work: each phase of the RL step as a small strategy object.

Which implementation a phase gets is decided once, when the trainer is built (e.g. no critic
-> ``Skip``), so the step itself has no feature ``if``s. The workers are reached through typed
clients (megarl/actors/clients.py); per-token results come back already zero past each
response's length, so no phase masks them again. Each phase first enters its phase of the
memory hand-over (megarl/memory/handover.py), which brings onto the devices what the phase
works with (megarl/memory/residency.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megarl.actors.clients import CriticClient, PolicyClient
from megarl.algos.kl import make_kl_controller
from megarl.algos.step import advantage_step
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.memory.handover import Handover
from megarl.memory.residency import (
    CRITIC_FORWARD,
    CRITIC_UPDATE,
    POLICY_FORWARD,
    POLICY_UPDATE,
    REFERENCE_FORWARD,
    WEIGHT_PUSH,
)
from megarl.progress import still_waiting


class Skip:
    """A phase that is off in this configuration."""

    def __call__(self, batch: Batch, *args: Any) -> Batch:
        return batch

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        return {}


class PolicyForward:
    """The policy's log-probs, in the policy_forward phase (the old log-probs; the post-push
    check's trainer side, megarl/weight_sync/logprob_check.py)."""

    def __init__(self, policy: PolicyClient, handover: Handover):
        self.policy, self.handover = policy, handover

    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        self.handover.enter(POLICY_FORWARD)
        return self.policy.compute_logprobs(batch, temperature)

    def compute_logprobs_and_reference(self, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's and the reference's log-probs in one pass (the reference stays on the device)."""
        self.handover.enter(POLICY_FORWARD)
        return self.policy.compute_logprobs_and_reference(batch, temperature)


class OldLogprobs:
    """The policy's log-probs before the update (needed off-policy: several epochs or mini-batches);
    ``with_reference``: the reference's too, in the same pass (the step's reference phase is then
    skipped: megarl/trainer/build.py)."""

    def __init__(self, policy: PolicyForward, temperature: float, with_reference: bool = False):
        self.policy, self.temperature, self.with_reference = policy, temperature, with_reference

    def __call__(self, batch: Batch) -> Batch:
        if not self.with_reference:
            return batch.replace(old_logprobs=self.policy.compute_logprobs(batch, self.temperature))
        old, ref = self.policy.compute_logprobs_and_reference(batch, self.temperature)
        return batch.replace(old_logprobs=old, ref_logprobs=ref)


class EngineOldLogprobs:
    """The engine's log-probs as the old log-probs (``algorithm.old_logprobs: engine``): no forward.

    The ratio becomes pi_theta / pi_behaviour, the clip bounds the step from the policy that
    sampled (up to ``rollout.max_staleness`` versions old). Refused, in one line, when the engines
    reported no finite log-prob for a response token: a NaN there would poison the whole loss."""

    def __call__(self, batch: Batch) -> Batch:
        engine = batch.rollout_logprobs  # [B, R], 0 on padding
        if engine is None:
            raise ValueError("algorithm.old_logprobs=engine needs the engines' log-probs, and this batch has none; "
                             "set algorithm.old_logprobs=recompute")  # fmt: skip
        missing = int((~torch.isfinite(engine) & (batch.response_mask > 0)).sum())
        if missing:
            raise ValueError(f"algorithm.old_logprobs=engine: the engines reported no log-prob for {missing} response "
                             "tokens; set algorithm.old_logprobs=recompute")  # fmt: skip
        return batch.replace(old_logprobs=engine)


class ReferenceLogprobs:
    def __init__(self, policy: PolicyClient, temperature: float, handover: Handover):
        self.policy, self.temperature, self.handover = policy, temperature, handover

    def __call__(self, batch: Batch) -> Batch:
        self.handover.enter(REFERENCE_FORWARD)
        return batch.replace(ref_logprobs=self.policy.compute_ref_logprobs(batch, self.temperature))


class CriticPhase:
    """Values before the update, and the critic's own update."""

    def __init__(self, critic: CriticClient, handover: Handover):
        self.critic, self.handover = critic, handover

    def __call__(self, batch: Batch) -> Batch:
        self.handover.enter(CRITIC_FORWARD)
        return batch.replace(values=self.critic.compute_values(batch))

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        self.handover.enter(CRITIC_UPDATE)
        return self.critic.update(batch, step)  # public names (megarl/metrics.py), as the worker emits them


class PolicyUpdate:
    """The policy's update; skipped while the critic warms up (PPO)."""

    def __init__(self, policy: PolicyClient, temperature: float, warmup_steps: int, handover: Handover):
        self.policy, self.temperature, self.warmup_steps = policy, temperature, warmup_steps
        self.handover = handover

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        if step <= self.warmup_steps:
            return {}
        self.handover.enter(POLICY_UPDATE)
        return self.policy.update(batch, self.temperature, step)  # public names, as the worker emits them


class Advantages:
    """Scores -> token rewards (overlong shaping, KL in the reward) -> the estimator.

    Holds the KL controller (checkpointed by the trainer); the work is ``algos.advantage_step``.
    """

    def __init__(self, cfg: MegaRLConfig):
        self.cfg = cfg.algorithm
        self.max_new_tokens = cfg.rollout.sampling.max_new_tokens
        self.kl_controller = make_kl_controller(cfg.algorithm.kl)

    def __call__(self, batch: Batch, baseline: torch.Tensor | None) -> tuple[Batch, dict[str, float]]:
        return advantage_step(batch, self.cfg, self.kl_controller, self.max_new_tokens, baseline)


class WeightPush:
    """Policy -> engines after each update, in the weight_push phase (dead engines restarted,
    colocated SGLang's weights resumed, the policy's optimizer state off the GPUs), then the
    post-push log-prob check: ``check`` (or None) generates a few responses with the engines and
    compares their log-probs with the trainer's (megarl/weight_sync/logprob_check.py)."""

    def __init__(self, policy: PolicyClient, handover: Handover, check: Any = None,
                 pushed: Callable[[int], None] = lambda version: None):  # fmt: skip
        """``pushed(version)``: what the controller's side learns of a push (the engines' LoRA
        adapter name in adapter mode, megarl/weight_sync/lora_adapter.py)."""
        self.policy, self.handover, self.check, self.pushed = policy, handover, check, pushed

    def __call__(self, version: int) -> dict[str, float]:
        self.handover.enter(WEIGHT_PUSH)
        with still_waiting(f"weight push {version} (policy -> engines)"):  # minutes on a big model
            metrics = self.policy.push_weights(version)
        self.handover.pushed(version)
        self.pushed(version)
        if self.check is not None:
            metrics |= self.check(version)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The post-push check's baseline (checkpointed by the trainer); {} without a check."""
        return self.check.state_dict() if self.check is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.check is not None:
            self.check.load_state_dict(state)
