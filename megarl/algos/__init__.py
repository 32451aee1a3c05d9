"""RL algorithms as pure torch functions: advantages, policy/value losses, KL, TIS/MIS, DAPO, and
the metric accumulator (reductions of the catalogued metrics as tensor operations).

No torch.distributed, no Ray, no models: the controller calls the advantage functions on a
whole Batch, the Megatron workers call the LossFns on micro-batch slices. Names selectable
in the config live in registries (``ADVANTAGE_ESTIMATORS``, ``POLICY_LOSSES``,
``LOSS_AGGREGATIONS``, ``KL_ESTIMATORS``) that mirror megarl/config/algorithm_sections.py.
"""

from megarl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    group_stats,
    reward_kl,
    token_rewards_from_scores,
)
from megarl.algos.dapo import dynamic_sampling_filter, overlong_penalty, zero_var_group_frac
from megarl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)
from megarl.algos.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossFn,
    ModelOutputs,
    aggregate,
    make_policy_loss_fn,
    make_value_loss_fn,
)
from megarl.algos.metrics import MetricAccumulator, reduce_metrics
from megarl.algos.mismatch import (
    corrections_by_staleness,
    logprob_mismatch,
    mis_mask,
    mismatch_by_staleness,
    tis_weights,
)
from megarl.algos.registry import Registry, UnknownNameError
from megarl.algos.step import advantage_step

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "LossFn",
    "MetricAccumulator",
    "ModelOutputs",
    "Registry",
    "UnknownNameError",
    "advantage_step",
    "aggregate",
    "compute_advantages",
    "dynamic_sampling_filter",
    "group_stats",
    "kl_estimate",
    "logprob_mismatch",
    "make_kl_controller",
    "make_policy_loss_fn",
    "make_value_loss_fn",
    "mis_mask",
    "mismatch_by_staleness",
    "overlong_penalty",
    "reduce_metrics",
    "reward_kl",
    "tis_weights",
    "corrections_by_staleness",
    "token_rewards_from_scores",
    "zero_var_group_frac",
]
