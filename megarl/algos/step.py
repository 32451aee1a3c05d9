"""The controller's advantage phase of one RL step, composed from the pure functions.

``advantage_step`` is the ``batch = algos.advantages(batch, cfg.algo)`` line of the loop:
overlong shaping of the scores (DAPO), the KL penalty in the reward (with the controller's
current coefficient, then the controller update), token rewards, the configured estimator,
and the step's metrics under their public names (``reward/...``, ``advantages/...``; see
megarl/metrics.py), reduced by the same accumulator as the workers' metrics. It holds no state of its own (the KL controller is passed in and
checkpointed by the trainer) and leaves out dynamic sampling, which decides what to generate
and so belongs to the rollout phase (``dapo.dynamic_sampling_filter``).
"""

from __future__ import annotations

import torch

from megarl.algos.advantages import compute_advantages, reward_kl, token_rewards_from_scores
from megarl.algos.dapo import overlong_penalty
from megarl.algos.kl import KLController
from megarl.algos.metrics import pair, reduce_metrics
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.data.batch import Batch


def advantage_step(
    batch: Batch,
    cfg: AlgorithmConfig,
    kl_controller: KLController,
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
    scores = batch.scores.to(torch.float32)  # [B]
    metrics: dict[str, torch.Tensor] = {}  # public name -> [2] slice (megarl.algos.metrics)
    if cfg.overlong.length > 0:
        penalty = overlong_penalty(
            batch.response_lengths, max_new_tokens, cfg.overlong.length, cfg.overlong.penalty
        ).to(scores.device)  # [B]
        scores = scores + penalty
        metrics["reward/overlong_penalty_mean"] = pair(penalty.sum(), len(batch))
    kl, coef = None, 0.0
    if cfg.kl.use_in_reward:
        kl, current_kl = reward_kl(batch, cfg.kl)
        coef = kl_controller.value
        metrics["reward/kl"] = pair(current_kl)
        metrics["reward/kl_coef"] = pair(coef)
        kl_controller.update(float(current_kl), n_steps=len(batch))
    rewards = token_rewards_from_scores(scores, batch.response_lengths, mask, kl=kl, kl_coef=coef,
                                        turn_rewards=batch.turn_rewards)  # fmt: skip
    out = compute_advantages(batch.replace(token_rewards=rewards), cfg, baseline_scores)
    assert out.advantages is not None and out.returns is not None  # what compute_advantages fills
    valid = (mask > 0).to(out.advantages.dtype)  # [B, R]
    metrics["advantages/mean"] = pair((out.advantages * valid).sum(), valid.sum())
    metrics["advantages/return_mean"] = pair((out.returns * valid).sum(), valid.sum())
    return out, reduce_metrics([metrics])
