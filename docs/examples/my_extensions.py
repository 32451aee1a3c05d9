"""Examples of a user's own advantage estimator, policy loss and generate function.

Name them in a config by import path (this folder on PYTHONPATH, or your own package):

    algorithm.estimator: my_extensions:centered_score
    algorithm.policy_loss: my_extensions:unclipped_ratio
    rollout.generate_function: my_extensions:generate_with_prefix

See docs/extending.md for the signatures and where each function runs.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.algos.advantages import AdvantageInputs
from megarl.algos.losses import PolicyLossTerms
from megarl.config.algorithm_sections import AlgorithmConfig, ClipConfig
from megarl.rollout.single_turn import generate_batch


def centered_score(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's score minus the batch's mean score, on every response token (runs on the
    controller). Returns ``(advantages, returns)``, both ``[B, R]`` and zero where masked."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)  # [B, R]
    scores = inputs.token_rewards.sum(-1)  # [B]: the outcome sits on the last token
    advantages = (scores - scores.mean())[:, None] * mask  # [B, R]
    return advantages, scores[:, None] * mask


def unclipped_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip: ClipConfig) -> PolicyLossTerms:  # fmt: skip
    """``-A * ratio`` per token without clipping (runs in every policy process, with grad)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # [B, R]
    ratio = torch.exp(log_ratio)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return PolicyLossTerms(loss=-advantages * ratio, ratio=ratio.detach(), log_ratio=log_ratio.detach(),
                           clipped=none, clipped_lower=none)  # fmt: skip


def generate_with_prefix(engines, prompts, params):
    """The default single-turn generation, with a fixed token appended to every prompt (what a
    custom rollout looks like: PromptBatch in, a Batch that follows megarl.data.batch out)."""
    prefixed = dataclasses.replace(prompts, prompt_ids=[ids + ids[-1:] for ids in prompts.prompt_ids])
    return generate_batch(engines, prefixed, params)
