"""Train/inference mismatch: truncated importance sampling (TIS) and the log-prob gap metric.

The engine samples from pi_rollout (SGLang kernels, maybe another precision), the trainer
computes pi_train for the same tokens; they differ a little, and the policy gradient is then
off-policy. TIS reweights each token (``token``) or each sequence (``sequence``) by
pi_train / pi_rollout, capped at ``cap`` (truncation bounds the variance), detached: it is a
constant per token in the loss. Sequence weights multiply over the valid tokens, computed in
log space and capped before ``exp`` so long sequences never overflow.

Deliberately not here: masking/rejecting sequences by weight (only truncation), and any
decision about which trainer log-probs to use (the loss passes old log-probs when it has them).
"""

from __future__ import annotations

import math

import torch

LOG_FLOOR = -20.0  # weights below exp(-20) are 0 for every practical purpose


def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    cap: float,
) -> torch.Tensor:
    """[B, R] detached min(pi_train / pi_rollout, cap) per token or per sequence; 1 on padding.

    ``level`` is "token" or "sequence" (``algorithm.tis.level``; "none" gives all ones).
    """
    if level == "none":
        return torch.ones_like(train_logprobs)
    mask = response_mask.to(train_logprobs.dtype)
    log_ratio = (train_logprobs.detach() - rollout_logprobs) * mask  # [B, R]
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)  # [B, R]
    else:
        raise ValueError(f"algorithm.tis.level must be none, token or sequence, got {level!r}")
    weights = torch.exp(log_w.clamp(LOG_FLOOR, math.log(cap)))
    return torch.where(mask > 0, weights, torch.ones_like(weights))


def logprob_mismatch(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Metric ``[2] = (sum, count)`` of |logp_train - logp_rollout| over valid tokens."""
    mask = response_mask.to(train_logprobs.dtype)
    gap = ((train_logprobs.detach() - rollout_logprobs).abs() * mask).sum()
    return torch.stack([gap, mask.sum()])

