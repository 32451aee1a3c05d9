"""The ``algorithm`` section of the key tree of megarl/config/sections.py: advantage estimator,
policy loss and its aggregation, clipping, KL, importance weights (TIS / MIS), dynamic sampling and
the overlong penalty; and the names each selects (megarl.algos' registries hold the
implementations; a test keeps both lists equal). Torch-free, like every config module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.section_base import Section, builtin_or_import_path

# Names selectable in the config; megarl.algos' registries hold the implementations and a test
# keeps both lists equal (the planner must not import torch to validate a name).
ESTIMATORS = (
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
)
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# "+": verl's straight-through variants, the estimator's value with k2's gradient (megarl/algos/kl.py).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
# verl's names (algorithm.kl_penalty, actor.kl_loss_type) for the same estimators; "full" (the
# whole-vocabulary KL) is refused by KLConfig with its reason. k2+ is k2 (its own gradient).
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2", "k2+": "k2", "low_var_kl+": "k3+"}
KLEstimatorName = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]


class ClipConfig(Section):
    low: float = Field(0.2, ge=0, description="Lower clip ratio epsilon (ratio >= 1 - low).")
    high: float = Field(0.2, ge=0, description="Upper clip ratio epsilon (ratio <= 1 + high); DAPO clip-higher uses 0.28.")
    dual_c: float | None = Field(3.0, gt=1, description="Dual-clip bound for negative advantages; None disables.")
    value: float | None = Field(0.2, gt=0, description="Value-function clip range of the critic loss; None disables.")


class KLConfig(Section):
    use_in_reward: bool = Field(False, description="Subtract the reward coefficient x KL from the token rewards (verl's use_kl_in_reward).")
    use_in_loss: bool = Field(False, description="Add the loss coefficient x KL to the policy loss (verl's use_kl_loss).")
    estimator: KLEstimatorName = Field(
        "k3",
        description="KL estimator of both uses unless reward_estimator / loss_estimator say otherwise: k1, k2, k3 "
        "(low-variance KL), abs; verl's kl, mse, low_var_kl are read as k1, k2, k3. A trailing + (k1+, k3+, abs+; "
        "verl's kl+, low_var_kl+) is verl's straight-through variant: the estimator's value, k2's gradient.",
    )
    coef: float = Field(0.001, ge=0, description="KL coefficient of both uses unless reward_coef / loss_coef say otherwise (the reward's is the adaptive controller's initial value).")
    reward_estimator: KLEstimatorName | None = Field(None, description="Estimator of the KL penalty in the reward (verl's algorithm.kl_penalty); None = estimator.")
    reward_coef: float | None = Field(None, ge=0, description="Coefficient of the KL penalty in the reward, the adaptive controller's initial value (verl's algorithm.kl_ctrl.kl_coef); None = coef.")
    loss_estimator: KLEstimatorName | None = Field(None, description="Estimator of the KL term in the policy loss (verl's actor.kl_loss_type); None = estimator.")
    loss_coef: float | None = Field(None, ge=0, description="Coefficient of the KL term in the policy loss (verl's actor.kl_loss_coef); None = coef.")
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep the reward's coefficient fixed or adapt it towards target.")
    target: float = Field(0.01, gt=0, description="Target KL of the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Horizon of the adaptive controller.")

    @field_validator("estimator", "reward_estimator", "loss_estimator", mode="before")
    @classmethod
    def _verl_estimator_names(cls, value: object) -> object:
        """verl's names for the same estimators; its ``full`` is refused with the reason."""
        if value == "full":
            raise ValueError(
                "full (the whole-vocabulary KL) needs both models' distributions over the vocabulary at every "
                "token, and megarl's log-prob pass keeps only the sampled token's log-prob (verl does not "
                "implement it either); use k3 (low_var_kl), k1 (kl), k2 (mse) or abs"
            )
        return KL_ESTIMATOR_ALIASES.get(value, value) if isinstance(value, str) else value

    @property
    def enabled(self) -> bool:
        return self.use_in_reward or self.use_in_loss

    @property
    def reward_kl_estimator(self) -> str:
        """The estimator of the KL penalty in the reward."""
        return self.reward_estimator or self.estimator

    @property
    def reward_kl_coef(self) -> float:
        """The (initial) coefficient of the KL penalty in the reward."""
        return self.coef if self.reward_coef is None else self.reward_coef

    @property
    def loss_kl_estimator(self) -> str:
        """The estimator of the KL term in the policy loss (and of the actor/kl metric)."""
        return self.loss_estimator or self.estimator

    @property
    def loss_kl_coef(self) -> float:
        """The coefficient of the KL term in the policy loss."""
        return self.coef if self.loss_coef is None else self.loss_coef


class TISConfig(Section):
    level: Literal["none", "token", "sequence"] = Field("none", description="Truncated importance sampling against the engine's log-probs.")
    cap: float = Field(2.0, gt=0, description="Cap of the importance weight.")


class MISConfig(Section):
    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Masked importance sampling against the engine's log-probs: drop from the policy-gradient loss each token "
        "(token), or each whole sequence (sequence: product of its token ratios; geometric: their geometric mean), whose ratio "
        "pi_train / pi_rollout falls outside [low, high]. Composes with tis (tis truncates, mis masks). Masked tokens add 0 "
        "to the loss but still count in its normaliser.",
    )
    low: float = Field(0.5, gt=0, description="Smallest kept ratio pi_train / pi_rollout.")
    high: float = Field(2.0, gt=0, description="Largest kept ratio pi_train / pi_rollout; must exceed low.")

    @model_validator(mode="after")
    def _low_below_high(self) -> MISConfig:
        if self.low >= self.high:
            raise ValueError(f"algorithm.mis.low ({self.low}) must be below algorithm.mis.high ({self.high})")
        return self


class DynamicSamplingConfig(Section):
    enabled: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and generate more.")
    max_rounds: int = Field(3, ge=1, description="Generation rounds per step at most before training on what is there.")


class OverlongConfig(Section):
    length: int = Field(0, ge=0, description="DAPO overlong shaping: penalise the last `length` tokens before max_new_tokens; 0 disables.")
    penalty: float = Field(1.0, ge=0, description="Penalty at the limit (linear from 0 over the window).")


class AlgorithmConfig(Section):
    estimator: str = Field(
        "grpo",
        description=f"Advantage estimator: {', '.join(ESTIMATORS)}, or your own as package.module:function (docs/extending.md).",
    )
    policy_loss: str = Field(
        "ppo",
        description="ppo (token ratio), gspo (sequence ratio), or your own as package.module:function (docs/extending.md).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (gae, reinforce++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_by_std: bool = Field(True, description="Divide group-relative advantages by the group's std (grpo).")
    clip: ClipConfig = Field(default_factory=ClipConfig, description="Ratio and value clipping.")
    loss_agg: Literal[LOSS_AGGS] = Field("token-mean", description="How token losses are aggregated.")  # type: ignore[valid-type]
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL to the reference policy.")
    tis: TISConfig = Field(default_factory=TISConfig, description="Train/inference mismatch correction.")
    mis: MISConfig = Field(default_factory=MISConfig, description="Train/inference mismatch masking (composes with tis).")
    old_logprobs: Literal["recompute", "engine"] = Field(
        "recompute",
        description="The PPO ratio's old log-probs: recompute (the trainer's forward before the update; skipped when a "
        "synchronous step is strictly on-policy) or engine (the rollout engine's own log-probs of the sampled tokens, "
        "no forward: the ratio is pi_theta / pi_behaviour, docs/async.md).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO overlong reward shaping.")

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, value: str) -> str:
        return builtin_or_import_path(value, ESTIMATORS, "estimator")

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, value: str) -> str:
        return builtin_or_import_path(value, POLICY_LOSSES, "policy_loss")
