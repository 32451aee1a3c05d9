"""Train/inference mismatch: importance weights (TIS), masks (MIS) and the log-prob gap metrics.

The engine samples from pi_rollout (SGLang kernels, maybe another precision, and in asynchronous
runs a policy up to ``rollout.max_staleness`` versions older), the trainer computes pi_train for
the same tokens; they differ, and the policy gradient is then off-policy. Both corrections look
at the ratio pi_train / pi_rollout per token (``token``) or per sequence; both are detached:
constants per token in the loss.

- Truncated importance sampling (TIS, ``algorithm.tis``) reweights by the ratio capped at
  ``cap`` (truncation bounds the variance). Sequence weights multiply over the valid tokens,
  computed in log space and capped before ``exp`` so long sequences never overflow.
- Masked importance sampling (MIS, ``algorithm.mis``) keeps the tokens whose ratio lies in
  ``[low, high]`` (weight 1) and drops the others (weight 0): a token the engine sampled from
  a too different policy teaches nothing rather than a truncated something. At ``sequence``
  level the ratio is the product over the valid tokens, at ``geometric`` level their geometric
  mean exp(mean log ratio) (length-independent); a masked sequence loses all its tokens. A
  masked token stays in the loss normaliser: it adds 0 to the sum but still counts as a valid
  token in token-mean (AReaL's decoupled loss does the same with its behaviour-weight cap;
  verl's rollout rejection instead takes rejected tokens out of ``response_mask``). So the
  normaliser never depends on the ratios, and many masked tokens shrink the step.

Both compose (the loss multiplies the TIS weight and the MIS mask). Deliberately not here: any
decision about which trainer log-probs to use (the loss passes old log-probs when it has them:
in asynchronous runs they are the recomputed proximal policy).
"""

from __future__ import annotations

import math

import torch

LOG_FLOOR = -20.0  # weights below exp(-20) are 0 for every practical purpose


def _tis_log_weights(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, level: str
) -> torch.Tensor:
    """[B, R] log(pi_train / pi_rollout) per token, or the sequence's sum spread over its row (MIS's
    :func:`_sequence_log_ratio`); 0 on padding."""
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.tis.level must be none, token or sequence, got {level!r}")
    mask = response_mask.to(train_logprobs.dtype)
    log_ratio = torch.where(mask > 0, train_logprobs.detach() - rollout_logprobs, 0.0)  # [B, R]
    return _sequence_log_ratio(log_ratio, mask, level)


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
    log_w = _tis_log_weights(train_logprobs, rollout_logprobs, response_mask, level)
    weights = torch.exp(log_w.clamp(LOG_FLOOR, math.log(cap)))
    return torch.where(response_mask.to(weights.dtype) > 0, weights, torch.ones_like(weights))


def tis_capped(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    cap: float,
) -> torch.Tensor:
    """[B, R] 0/1 (the log-probs' dtype): the tokens whose TIS weight is the cap. Compared in log
    space: exp(log(cap)) rounds below cap for many caps (3.5 in fp32), so ``weights >= cap`` would
    miss them."""
    if level == "none":
        return torch.zeros_like(train_logprobs)
    log_w = _tis_log_weights(train_logprobs, rollout_logprobs, response_mask, level)
    return ((log_w >= math.log(cap)) & (response_mask.to(log_w.dtype) > 0)).to(train_logprobs.dtype)


def logprob_mismatch(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Metric ``[2] = (sum, count)`` of |logp_train - logp_rollout| over valid tokens."""
    mask = response_mask.to(train_logprobs.dtype)
    gap = ((train_logprobs.detach() - rollout_logprobs).abs() * mask).sum()
    return torch.stack([gap, mask.sum()])


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, R] the per-token ``log_ratio`` (0 on padding) at ``level``: itself (token), the
    sequence's sum (sequence: the log of the product) or mean (geometric), spread over its row."""
    if level == "token":
        return log_ratio
    total = log_ratio.sum(-1, keepdim=True)  # [B, 1]
    if level == "sequence":
        return total.expand_as(log_ratio)
    if level == "geometric":
        return (total / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    raise ValueError(
        f"algorithm.mis.level must be none, token, sequence or geometric, got {level!r}"
    )


def mis_mask(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """[B, R] detached 0/1: 1 where the ratio pi_train / pi_rollout at ``level`` lies in
    ``[low, high]``, 0 where it falls outside; 1 on padding (the loss masks padding itself).

    ``level`` is ``algorithm.mis.level``: "token", "sequence" (product of the token ratios),
    "geometric" (their geometric mean); "none" gives all ones. Compared in log space, so a
    sequence product far beyond float range is still masked, never inf or nan.
    """
    if level == "none":
        return torch.ones_like(train_logprobs)
    mask = response_mask.to(train_logprobs.dtype)
    # where, not * mask: an -inf log-prob on padding would make 0 * inf = nan in the row's sum
    log_ratio = torch.where(mask > 0, train_logprobs.detach() - rollout_logprobs, 0.0)  # [B, R]
    log_r = _sequence_log_ratio(log_ratio, mask, level)  # [B, R]
    keep = (log_r >= math.log(low)) & (log_r <= math.log(high))
    return (keep | (mask == 0)).to(train_logprobs.dtype)


def mismatch_by_staleness(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    staleness: torch.Tensor,
) -> dict[str, float]:
    """``rollout/logprob_mismatch/staleness<s>``: mean |old - rollout| log-prob over the valid
    tokens of the samples ``s`` policy versions old, for each ``s`` in ``staleness`` ([B] long).

    Controller side, once per step: how far the engine's log-probs drift as samples age (at
    s = 0 only the kernel / precision gap remains). A staleness whose samples have no valid
    token is left out (a mean over nothing).
    """
    mask = response_mask.to(old_logprobs.dtype)
    gap = torch.where(mask > 0, (old_logprobs - rollout_logprobs).abs(), 0.0).sum(-1)  # [B]
    tokens = mask.sum(-1)  # [B]
    out: dict[str, float] = {}
    for s in torch.unique(staleness).tolist():
        rows = staleness == s  # [B]
        n = tokens[rows].sum().item()
        if n > 0:
            out[f"rollout/logprob_mismatch/staleness{s}"] = gap[rows].sum().item() / n
    return out


def corrections_by_staleness(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    staleness: torch.Tensor,
    tis: tuple[str, float],
    mis: tuple[str, float, float],
) -> dict[str, float]:
    """The off-policy corrections per staleness: ``rollout/tis_weight/staleness<s>`` and
    ``rollout/tis_capped_frac/staleness<s>`` (``tis`` = (level, cap), when its level is not
    "none"), ``rollout/mis_masked_frac/staleness<s>`` (``mis`` = (level, low, high)), each over
    the valid tokens of the samples ``s`` versions old (``staleness``: [B] long).

    Controller side, once per step: the weights and masks depend only on the old (proximal) and
    the engine's log-probs, both fixed for the step, so these are the values every mini-batch's
    loss uses. A staleness whose samples have no valid token is left out.
    """
    mask = response_mask.to(old_logprobs.dtype)  # [B, R]
    per_token: dict[str, torch.Tensor] = {}  # metric name (a template of s) -> [B, R]
    if tis[0] != "none":
        per_token["rollout/tis_weight/staleness{s}"] = tis_weights(old_logprobs, rollout_logprobs, response_mask, *tis)
        per_token["rollout/tis_capped_frac/staleness{s}"] = tis_capped(old_logprobs, rollout_logprobs, response_mask, *tis)
    if mis[0] != "none":
        per_token["rollout/mis_masked_frac/staleness{s}"] = 1.0 - mis_mask(old_logprobs, rollout_logprobs, response_mask, *mis)
    tokens = mask.sum(-1)  # [B]
    out: dict[str, float] = {}
    for s in torch.unique(staleness).tolist():
        rows = staleness == s  # [B]
        n = tokens[rows].sum().item()
        for name, values in per_token.items():
            if n > 0:
                out[name.format(s=s)] = (values[rows] * mask[rows]).sum().item() / n
    return out
