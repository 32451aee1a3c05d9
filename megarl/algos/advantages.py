"""Advantage estimators, registered by name, and the group statistics they share.

An estimator is ``fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> (advantages, returns)``,
both ``[B, R]``, zero wherever ``response_mask`` is 0. Outcome estimators read each sample's
score as ``token_rewards.sum(-1)`` (the outcome sits on the last response token, a KL penalty
in the reward is spread over the tokens), so everything enters through ``token_rewards``;
``token_rewards_from_scores`` builds it.

Semantics follow verl's ``core_algos`` on valid tokens so that numbers agree:

- grpo: (s - mean_g) / (std_g + 1e-6), std unbiased; dr_grpo: s - mean_g (no std, and
  ``cfg.norm_by_std=False`` turns grpo into it); rloo: (s - mean_g) * n / (n - 1), i.e. s minus
  the mean of the others; reinforce_plus_plus_baseline: s - mean_g broadcast over tokens, then
  whitened over all valid tokens of the batch. In every group estimator a group of one keeps
  its raw score and a group whose scores are all equal gets exactly 0 before any batch
  whitening (tested bit-exact: not "(s - mean) / (0 + eps)", which amplifies rounding).
- gae and reinforce_plus_plus: the backward recursions skip masked positions (a masked token
  carries the running value through and its reward is dropped), then advantages are whitened
  over the batch's valid tokens; returns are not whitened.
- remax: returns = reverse cumsum of masked token rewards, advantages = returns - baseline,
  with the baseline being the score of the greedy response to the same prompt.

Group ids are arbitrary integers (``Batch.group_id``); groups are handled with
``unique`` + ``index_add`` / ``scatter_reduce``, never Python loops over samples. The GAE
recursion runs as a two-level chunked linear scan (``discounted_reverse_scan``): only powers
``<= 1`` of gamma * lambda appear, so it is stable at any length, unlike a cumsum scaled by
``(gamma * lambda) ** -t``. Deliberately left out: process rewards, multi-turn observation
handling beyond the mask, and anything that needs a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algos.kl import kl_estimate
from megarl.algos.registry import Registry
from megarl.config.algorithm_sections import AlgorithmConfig, KLConfig
from megarl.data.batch import Batch

GRPO_EPS = 1e-6  # added to the group std (verl's epsilon)
WHITEN_EPS = 1e-8  # added to the batch variance
SCAN_CHUNK = 64  # time steps per block of the chunked scan


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read; per-sample rows aligned with the Batch."""

    token_rewards: torch.Tensor  # [B, R] outcome on the last response token, minus KL if in reward
    response_mask: torch.Tensor  # [B, R] 1 = token counts
    group_id: torch.Tensor  # [B] long, samples of one prompt share an id
    values: torch.Tensor | None = None  # [B, R] critic values (gae)
    baseline_scores: torch.Tensor | None = None  # [B] score of the greedy response (remax)


Estimator = Callable[[AdvantageInputs, AlgorithmConfig], tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


# ---- group statistics -------------------------------------------------------------------
@dataclass(frozen=True)
class GroupStats:
    index: torch.Tensor  # [B] long, dense group index 0..G-1 of each sample
    count: torch.Tensor  # [G] samples per group
    mean: torch.Tensor  # [G]
    std: torch.Tensor  # [G] unbiased; 0 for groups of one
    constant: torch.Tensor  # [G] bool, every score in the group is equal (groups of one too)


def group_stats(scores: torch.Tensor, group_id: torch.Tensor) -> GroupStats:
    """Per-group count, mean, unbiased std and all-equal flag of ``scores [B]``."""
    _, index = torch.unique(group_id, return_inverse=True)  # [B]
    num = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(num)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count
    dev = scores - mean[index]  # two-pass variance: no cancellation
    std = (zeros.index_add(0, index, dev * dev) / (count - 1).clamp(min=1)).sqrt()
    high = scores.new_full((num,), -torch.inf).scatter_reduce(0, index, scores, "amax")
    low = scores.new_full((num,), torch.inf).scatter_reduce(0, index, scores, "amin")
    return GroupStats(index, count, mean, std, high == low)


def _group_relative(scores: torch.Tensor, group_id: torch.Tensor, scale: str) -> torch.Tensor:
    """[B] group-relative scalar: s - mean_g, scaled by ``scale`` in {"none", "std", "loo"}.

    Groups of one keep the raw score; all-equal groups give exactly 0.
    """
    st = group_stats(scores, group_id)
    n = st.count[st.index]
    centred = scores - st.mean[st.index]
    if scale == "std":
        centred = centred / (st.std[st.index] + GRPO_EPS)
    elif scale == "loo":
        centred = centred * n / (n - 1).clamp(min=1)
    centred = torch.where(st.constant[st.index], torch.zeros_like(centred), centred)
    return torch.where(n == 1, scores, centred)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] (x - mean) / sqrt(var + 1e-8) over the valid tokens (unbiased var), 0 elsewhere."""
    n = mask.sum()
    # torch's sum reduces pairwise (error ~ log n); a BLAS dot accumulates sequentially in fp32
    # and loses ~1e-4 relative over a million tokens, so sums stay sums here
    mean = (x * mask).sum() / n.clamp(min=1)
    centred = (x - mean).mul_(mask)
    var = centred.square().sum() / (n - 1).clamp(min=1)
    return centred.mul_(torch.rsqrt(var + WHITEN_EPS))


# ---- the chunked linear scan ------------------------------------------------------------
def _power_matrix(c: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size, size] lower-triangular M[i, j] = c ** (i - j) for i >= j, else 0.

    Powers below 1e-30 are set to 0: they do not change fp32 sums and denormals slow matmuls.
    """
    steps = torch.arange(size, dtype=torch.float64, device=device)
    diff = steps[:, None] - steps[None, :]
    powers = torch.pow(torch.tensor(c, dtype=torch.float64, device=device), diff.clamp(min=0))
    keep = (diff >= 0) & (powers >= 1e-30)
    return torch.where(keep, powers, torch.zeros_like(powers)).to(dtype)


def discounted_reverse_scan(x: torch.Tensor, c: float, chunk: int = SCAN_CHUNK) -> torch.Tensor:
    """[B, L] y with y_t = x_t + c * y_{t+1} (y_L = 0), for 0 <= c <= 1.

    Blocks of ``chunk`` steps are solved by one matmul with the matrix of powers of c
    (``local[k, j] = sum_{i >= j} c^(i-j) x[k, i]``); the value at the start of each block
    solves the same recurrence over blocks with c ** chunk, again one matmul; block k then adds
    ``c^(chunk-j)`` times the start of block k + 1. Only powers <= 1 occur: nothing overflows.
    """
    b, length = x.shape
    if length == 0:
        return x.clone()
    blocks = -(-length // chunk)
    padded = blocks * chunk
    xp = x if padded == length else torch.nn.functional.pad(x, (0, padded - length))
    local = xp.reshape(b, blocks, chunk) @ _power_matrix(c, chunk, x.dtype, x.device)  # [B, K, C]
    starts = local[..., 0] @ _power_matrix(c**chunk, blocks, x.dtype, x.device)  # [B, K]
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # [B, K] start of the next block
    tail = torch.pow(
        torch.tensor(c, dtype=torch.float64), torch.arange(chunk, 0, -1, dtype=torch.float64)
    ).to(dtype=x.dtype, device=x.device)  # [C] c^(C - j)
    out = local.addcmul_(carry[..., None], tail).view(b, padded)
    return out if padded == length else out[:, :length]


def _compact(x: torch.Tensor, valid: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[B, R] the valid entries of each row moved to its front (order kept), zeros after."""
    return torch.zeros_like(x).scatter_add_(1, position, torch.where(valid, x, torch.zeros_like(x)))


def _deltas(
    x: torch.Tensor, values: torch.Tensor, gamma: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, L] m_t (x_t - V_t) + gamma * m_{t+1} V_{t+1} on rows whose valid entries are at the
    front (``mask`` None: already compacted, m = 1). One new tensor, the rest in place: on CPU
    every fresh [B, R] tensor costs page faults comparable to the arithmetic."""
    delta = x - values
    if mask is None:
        delta[:, :-1].add_(values[:, 1:], alpha=gamma)
    else:
        delta.mul_(mask)
        delta[:, :-1].addcmul_(values[:, 1:], mask[:, 1:], value=gamma)
    return delta


def masked_reverse_scan(
    x: torch.Tensor,
    mask: torch.Tensor,
    c: float,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Reverse recursion over the valid tokens only, as if masked tokens were not there.

    Without ``values``: y_t = x_t + c * y_next. With ``values`` (GAE):
    delta_t = x_t + gamma * V_next - V_t and y_t = delta_t + c * y_next, where "next" is the
    next valid position (0 past the last). Returns ``[B, R]``, 0 at masked positions.
    Rows whose valid tokens are a prefix (the usual case) are scanned in place; rows with holes
    (tool tokens, observations) are compacted first and scattered back.
    """
    valid = mask > 0
    if bool((valid[:, 1:] <= valid[:, :-1]).all()):  # prefix rows: zeros past each row's end
        m = mask if mask.dtype == x.dtype else valid.to(x.dtype)
        xc = x * m if values is None else _deltas(x, values, gamma, m)
        return discounted_reverse_scan(xc, c)  # stays exactly 0 past each end
    position = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, R] column in the compacted row
    xc = _compact(x, valid, position)
    if values is not None:
        xc = _deltas(xc, _compact(values, valid, position), gamma)
    return discounted_reverse_scan(xc, c).gather(1, position) * valid


# ---- estimators -------------------------------------------------------------------------
def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return inputs.token_rewards.sum(-1)  # [B]


def _broadcast(scalar: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = scalar[:, None] * mask  # [B, R]
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) from critic values; advantages whitened over the batch, returns = A + V."""
    if inputs.values is None:
        raise ValueError(
            "algorithm.estimator 'gae' needs critic values; enable the critic or pick grpo"
        )
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    adv = masked_reverse_scan(
        inputs.token_rewards, mask, cfg.gamma * cfg.lam, inputs.values, cfg.gamma
    )
    returns = torch.add(adv, inputs.values).mul_(mask)
    return masked_whiten(adv, mask), returns


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative, divided by the group std unless ``cfg.norm_by_std`` is False."""
    scale = "std" if cfg.norm_by_std else "none"
    return _broadcast(
        _group_relative(_scores(inputs), inputs.group_id, scale), inputs.response_mask
    )


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: group-relative without std normalisation."""
    return _broadcast(
        _group_relative(_scores(inputs), inputs.group_id, "none"), inputs.response_mask
    )


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: s_i - mean of the other samples of the group."""
    return _broadcast(
        _group_relative(_scores(inputs), inputs.group_id, "loo"), inputs.response_mask
    )


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    inputs: AdvantageInputs, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted returns (gamma) per token, whitened over the batch's valid tokens."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    returns = masked_reverse_scan(inputs.token_rewards, mask, cfg.gamma)
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    inputs: AdvantageInputs, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """s - mean_g on every token, then whitened over the batch (REINFORCE++ with baseline)."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    centred = _group_relative(_scores(inputs), inputs.group_id, "none")[:, None] * mask
    adv = masked_whiten(centred, mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns-to-go minus the greedy response's score (``baseline_scores``)."""
    if inputs.baseline_scores is None:
        raise ValueError(
            "algorithm.estimator 'remax' needs baseline_scores (scores of greedy responses)"
        )
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    # undiscounted returns-to-go with the chunked scan: fewer fresh [B, R] tensors than
    # flip + cumsum + flip, about 1.5x faster on CPU
    returns = discounted_reverse_scan(inputs.token_rewards * mask, 1.0).mul_(mask)
    advantages = torch.addcmul(returns, inputs.baseline_scores[:, None], mask, value=-1.0)
    return advantages, returns


# ---- from the Batch -----------------------------------------------------------------------
def token_rewards_from_scores(
    scores: torch.Tensor,
    response_lengths: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, R] the score on each row's last response token, plus ``turn_rewards`` [B, R] (agent
    loops' per-turn rewards, each on its turn's last generated token), minus ``kl_coef * kl`` on
    valid tokens.

    An empty response keeps its score at position 0 (masked out of the loss, still counted by
    the outcome estimators, which sum the row) so its group statistics stay right.
    """
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    last = (response_lengths.to(torch.long) - 1).clamp(min=0)[:, None]  # [B, 1]
    rewards.scatter_(1, last, scores[:, None].to(rewards.dtype))
    if turn_rewards is not None:
        rewards = rewards + turn_rewards.to(rewards.dtype)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * response_mask
    return rewards


def reward_kl(batch: Batch, cfg: KLConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL penalty ``[B, R]`` (masked) of old vs reference log-probs, and its mean
    per-sequence value (token mean per row, then mean over rows) for the adaptive controller."""
    if batch.old_logprobs is None or batch.ref_logprobs is None:
        raise ValueError(
            "algorithm.kl.use_in_reward needs old_logprobs and ref_logprobs in the batch"
        )
    mask = batch.response_mask
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, cfg.reward_kl_estimator) * mask
    per_row = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return kl, per_row.mean()


def compute_advantages(
    batch: Batch, cfg: AlgorithmConfig, baseline_scores: torch.Tensor | None = None
) -> Batch:
    """Fill ``advantages`` and ``returns`` from ``batch.token_rewards`` with ``cfg.estimator``."""
    if batch.token_rewards is None:
        raise ValueError(
            "compute_advantages needs batch.token_rewards; build it with token_rewards_from_scores"
        )
    inputs = AdvantageInputs(
        token_rewards=batch.token_rewards,
        response_mask=batch.response_mask,
        group_id=batch.group_id,
        values=batch.values,
        baseline_scores=baseline_scores,
    )
    with torch.no_grad():
        advantages, returns = ADVANTAGE_ESTIMATORS.get(cfg.estimator)(inputs, cfg)
    return batch.replace(advantages=advantages, returns=returns)
