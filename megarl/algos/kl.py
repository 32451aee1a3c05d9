"""KL between the trained policy and the reference policy: per-token estimators and controllers.

Estimators take per-token log-probs and return a per-token estimate of KL(pi || pi_ref)
(http://joschu.net/blog/kl-approx.html):

    k1   log pi - log pi_ref                      ("kl"); unbiased, high variance, can be negative
    k2   0.5 * (log pi - log pi_ref)^2            ("mse"); its gradient is the KL gradient
    k3   exp(d) - d - 1, d = log pi_ref - log pi  ("low_var_kl"); d clamped to [-20, 20] and
                                                  the result to [-10, 10] for stability
    abs  |log pi - log pi_ref|

(the quoted names are verl's ``kl_penalty`` names, read as aliases by ``KLConfig``.) A trailing
``+`` (``k1+``, ``k3+``, ``abs+``; verl's ``kl+``, ``low_var_kl+``) is verl's straight-through
variant: the named estimator's value forward, k2's gradient backward (k2's gradient is the KL's,
in expectation; k1's and k3's are not), so the loss term reads like k1 / k3 and trains like k2.
``k2+`` is k2 itself. An estimate
serves as a reward penalty (``advantages.token_rewards_from_scores``, with
``KLConfig.reward_kl_estimator`` / ``reward_kl_coef``) or as a loss term
(``losses.make_policy_loss_fn``, with ``loss_kl_estimator`` / ``loss_kl_coef``). Controllers hold the coefficient: fixed, or the
adaptive PPO rule (Ziegler et al. 2019) with a state_dict so the trainer can checkpoint it.
Masking is the caller's job: estimators are elementwise and never look at padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megarl.algos.registry import Registry
from megarl.config.algorithm_sections import KLConfig

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def _in_place_ok(*tensors: torch.Tensor) -> bool:
    """True when no autograd graph is being built: fresh buffers may then be reused in place
    (the reward-penalty path; on CPU each new [B, R] tensor costs as much as the arithmetic)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, R] log pi - log pi_ref."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, R] 0.5 * (log pi - log pi_ref)^2."""
    diff = logprobs - ref_logprobs
    if _in_place_ok(logprobs, ref_logprobs):
        return diff.square_().mul_(0.5)
    return 0.5 * diff.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, R] exp(d) - d - 1 with d = log pi_ref - log pi (non-negative, low variance)."""
    d = (ref_logprobs - logprobs).clamp_(-20.0, 20.0)  # exp(20) is still finite in fp32
    if _in_place_ok(logprobs, ref_logprobs):
        return torch.exp(d).sub_(d).sub_(1.0).clamp_(-10.0, 10.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, R] |log pi - log pi_ref|."""
    diff = logprobs - ref_logprobs
    return diff.abs_() if _in_place_ok(logprobs, ref_logprobs) else diff.abs()


def _straight_through(estimator: KLEstimator) -> KLEstimator:
    """``estimator``'s value with k2's gradient: k2 - k2.detach() + value.detach() (verl's
    core_algos.kl_penalty for a name ending in ``+``); the value alone where no graph is built."""

    def plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        value = estimator(logprobs, ref_logprobs)  # [B, R]
        if _in_place_ok(logprobs, ref_logprobs):
            return value
        k2 = 0.5 * (logprobs - ref_logprobs).square()  # [B, R]
        return k2 - k2.detach() + value.detach()

    plus.__doc__ = f"[B, R] {estimator.__name__}'s value, k2's gradient (straight-through)."
    return plus


for _name, _estimator in (("k1", kl_k1), ("k3", kl_k3), ("abs", kl_abs)):
    KL_ESTIMATORS.register(f"{_name}+")(_straight_through(_estimator))


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B, R] per-token KL estimate by name (see the module docstring)."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


class KLController(Protocol):
    """Holds the KL coefficient; ``update`` is called once per RL step."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, coef: float) -> None:
        self._value = float(coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Nothing to restore: a fixed coefficient is config, not state, so a resume with an
        edited ``algorithm.kl.coef`` / ``reward_coef`` (or from an adaptive run) uses the config's value."""


class AdaptiveKLController:
    """PPO's adaptive coefficient: move towards ``target`` KL over ``horizon`` samples.

    ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`` where ``n_steps`` is
    the number of samples (or steps, consistently) since the last update.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}"
            )
        self._value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self._value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """The adapted coefficient; target/horizon come from the (possibly edited) config. A
        fixed controller's state (no ``target``: the run switched to adaptive) is not an adapted
        value, so the controller starts from ``algorithm.kl.coef``."""
        if "target" in state:
            self._value = float(state["value"])


def make_kl_controller(cfg: KLConfig) -> FixedKLController | AdaptiveKLController:
    """The controller of the reward's KL coefficient selected by ``algorithm.kl.controller``,
    starting from ``reward_coef`` (``coef`` when unset)."""
    if cfg.controller == "adaptive":
        return AdaptiveKLController(cfg.reward_kl_coef, cfg.target, cfg.horizon)
    return FixedKLController(cfg.reward_kl_coef)
