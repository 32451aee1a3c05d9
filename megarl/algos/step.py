"""The controller's advantage phase of one RL step, composed from the pure functions.

``advantage_step`` is the ``batch = algos.advantages(batch, cfg.algo)`` line of the loop:
overlong shaping of the scores (DAPO), the KL penalty in the reward (with the controller's
current coefficient, then the controller update), token rewards, the configured estimator,
and the step's metrics. It holds no state of its own (the KL controller is passed in and
checkpointed by the trainer) and leaves out dynamic sampling, which decides what to generate
and so belongs to the rollout phase (``dapo.dynamic_sampling_filter``).
"""

from __future__ import annotations

import torch

from megarl.algos.advantages import compute_advantages, reward_kl, token_rewards_from_scores
from megarl.algos.dapo import overlong_penalty, zero_var_group_frac
from megarl.algos.kl import AdaptiveKLController, FixedKLController
from megarl.config.sections import AlgorithmConfig
from megarl.data.batch import Batch


def advantage_step(
    batch: Batch,
    cfg: AlgorithmConfig,
    kl_controller: FixedKLController | AdaptiveKLController,
    max_new_tokens: int,
    baseline_scores: torch.Tensor | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Fill ``token_rewards``, ``advantages`` and ``returns``; return the batch and metrics.

    ``batch.scores`` [B] must be set (the reward phase); ``old_logprobs`` and ``ref_logprobs``
    too when ``cfg.kl.use_in_reward``; ``values`` for gae; ``baseline_scores`` [B] for remax.
    """
    if batch.scores is None:
        raise ValueError("advantage_step needs batch.scores; run the reward phase first")
    mask = batch.response_mask
    scores = batch.scores.to(torch.float32)
    metrics: dict[str, float] = {
        "score_mean": float(scores.mean()) if len(batch) else 0.0,
        "zero_var_group_frac": zero_var_group_frac(scores, batch.group_id),
    }
    if cfg.overlong.length > 0:
        penalty = overlong_penalty(
            batch.response_lengths, max_new_tokens, cfg.overlong.length, cfg.overlong.penalty
        )
        scores = scores + penalty.to(scores.device)
        metrics["overlong_penalty_mean"] = float(penalty.mean()) if len(batch) else 0.0
    kl, coef = None, 0.0
    if cfg.kl.use_in_reward:
        kl, current_kl = reward_kl(batch, cfg.kl)
        coef = kl_controller.value
        metrics["reward_kl"] = float(current_kl)
        metrics["kl_coef"] = coef
        kl_controller.update(float(current_kl), n_steps=len(batch))
    rewards = token_rewards_from_scores(scores, batch.response_lengths, mask, kl=kl, kl_coef=coef)
    out = compute_advantages(batch.replace(token_rewards=rewards), cfg, baseline_scores)
    valid = mask > 0
    if bool(valid.any()):
        metrics["advantage_mean"] = float(out.advantages[valid].mean())
        metrics["return_mean"] = float(out.returns[valid].mean())
    return out, metrics
