"""Policy and value losses: the LossFn contract shared with the Megatron workers.

Megatron runs with ``calculate_per_token_loss=True``: a loss function returns the *sum* of its
loss over the micro-batch and the count it should be normalised by; Megatron adds both over
micro-batches and data-parallel ranks and divides once. So token-mean counts valid tokens and
the seq-mean modes count sequences, and the normalisation is global across the mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from megarl.algos.kl import kl_estimate
from megarl.algos.mismatch import logprob_mismatch, mis_mask, tis_capped, tis_weights
from megarl.algos.registry import Registry
from megarl.config.algorithm_sections import AlgorithmConfig, ClipConfig
from megarl.data.batch import Batch


@dataclass(frozen=True)
class ModelOutputs:
    """What the trainer's forward pass gives a loss function, aligned with the batch slice."""

    logprobs: torch.Tensor  # [b, R] log_softmax(logits / T) of the response tokens
    entropy: torch.Tensor | None = None  # [b, R] per-token entropy at temperature T
    values: torch.Tensor | None = None  # [b, R] critic values


class LossFn(Protocol):
    def __call__(
        self, batch: Batch, outputs: ModelOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss_sum, normaliser_count, metrics)``.

        ``loss_sum``: scalar tensor with grad; ``normaliser_count``: scalar tensor (tokens for
        token-mean, sequences for seq-mean modes), a function of the batch's rows alone, never of
        the outputs (:func:`loss_count` relies on it); ``metrics``: catalogued public name
        (megarl/metrics.py) -> a detached ``[2]`` tensor over the slice; the worker combines
        them over micro-batches, mini-batches and DP ranks by each name's reduction
        (megarl.algos.metrics).
        """
        ...


def loss_count(loss_fn: LossFn, batch: Batch, *, entropy: bool = False, values: bool = False) -> torch.Tensor:
    """The ``normaliser_count`` that ``loss_fn`` gives ``batch`` (float32), without a model: the
    count depends on the rows alone (LossFn contract), so zero outputs of the right shapes give
    it. Pipeline stages without the loss need it (the MoE auxiliary losses' weight).
    ``entropy`` / ``values``: which optional outputs ``loss_fn`` reads."""
    zeros = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.response_mask.device)  # [b, R]
    outputs = ModelOutputs(logprobs=zeros, entropy=zeros if entropy else None, values=zeros if values else None)
    return loss_fn(batch, outputs)[1].detach().float()


# =========================================================================================
# Implementations.
#
# A policy loss (registered under algorithm.policy_loss) maps per-token log-probs to a per-token
# loss matrix; an aggregation (algorithm.loss_agg) turns a matrix into (loss_sum, count) for
# Megatron's global division; ``make_policy_loss_fn`` / ``make_value_loss_fn`` compose them
# with the entropy bonus, the KL term, the TIS weights and the MIS mask into a LossFn. Because
# every aggregation is linear in the token losses, adding the terms per token and aggregating
# once equals aggregating each term (verl's way).
#
# Metrics are slices ``{public name: [2] tensor}`` (megarl.algos.metrics): the policy loss
# emits ``actor/...`` (and ``rollout/logprob_mismatch``), the value loss ``critic/...``, names
# and reductions declared once in megarl/metrics.py. Each pair is (sum over valid tokens, their
# count) for a mean, (extreme, 1) or (anything, 0) for a max / min over a slice.
# =========================================================================================

LOG_RATIO_CLAMP = 20.0  # |log ratio| clamp before exp (PPO token ratio)
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of GSPO's log ratio


@dataclass(frozen=True)
class PolicyLossTerms:
    loss: torch.Tensor  # [B, R] per-token policy-gradient loss (with grad)
    ratio: torch.Tensor  # [B, R] detached importance ratio the loss used
    log_ratio: torch.Tensor  # [B, R] detached log of it, clamped as the loss clamped it
    clipped: torch.Tensor  # [B, R] bool, the 1 -+ eps clip bound holds the ratio
    clipped_lower: torch.Tensor  # [B, R] bool, the dual-clip bound c holds it


PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ClipConfig], PolicyLossTerms
]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

Aggregation = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


# ---- policy losses ----------------------------------------------------------------------
def _clipped_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip: ClipConfig, dual_c: float | None
) -> PolicyLossTerms:
    """PPO's pessimistic clipped objective for a clamped log-ratio ``[B, R]`` (with grad).

    ``max(-A r, -A clip(r, 1 - low, 1 + high))``, and for A < 0 with dual clip also
    ``min(., -A c)``, equals ``-A r_eff`` with ``r_eff = min(r, 1 + high)`` where A >= 0 and
    ``clamp(r, 1 - low, c)`` where A < 0: same values, same gradients (zero where a bound is
    active), in a third of the elementwise passes. ``clipped`` marks tokens held by the
    1 -+ eps bounds (A != 0), ``clipped_lower`` those held by the dual-clip bound c.
    """
    ratio = torch.exp(log_ratio)
    positive = advantages >= 0
    upper = ratio.clamp(max=1.0 + clip.high)
    lower = ratio.clamp(min=1.0 - clip.low, max=dual_c)
    effective = torch.where(positive, upper, lower)
    loss = torch.mul(advantages, effective).neg_()
    r, e = ratio.detach(), effective.detach()
    if dual_c is None:
        dual = torch.zeros_like(positive)
    else:
        dual = (r > dual_c) & ~positive
    clipped = (e != r) & (advantages != 0) & ~dual
    return PolicyLossTerms(loss, r, log_ratio.detach(), clipped, dual)


@POLICY_LOSSES.register("ppo")
def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
) -> PolicyLossTerms:
    """Token-ratio clipped objective, ratio in [1 - low, 1 + high] (DAPO clip-higher when
    high > low); with ``dual_c`` the loss of a negative-advantage token is capped at -A * c."""
    log_ratio = (logprobs - old_logprobs).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_objective(log_ratio, advantages, clip, clip.dual_c)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipConfig,
) -> PolicyLossTerms:
    """GSPO: sequence ratio s_i = exp(mean_t log(pi / pi_old)) over valid tokens, clipped.

    Token-level form from the paper: s_it = sg[s_i] * pi_t / sg[pi_t] has the value s_i and
    gives each token the gradient s_i * grad log pi_t (instead of the 1/|y| share of the
    sequence ratio's gradient), so per-token advantages still work. No dual clip.
    """
    n = mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = ((logprobs.detach() - old_logprobs) * mask).sum(-1) / n  # [B]
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]  # [B, R] value log s_i
    return _clipped_objective(log_ratio.clamp(max=GSPO_LOG_RATIO_MAX), advantages, clip, None)


# ---- aggregations: (loss_sum, count), count summed globally by Megatron -----------------
@LOSS_AGGREGATIONS.register("token-mean")
def agg_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over valid tokens; count = valid tokens."""
    return _masked_sum(loss, mask), mask.sum().detach()


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar sum of x over valid tokens (pairwise-summed: a BLAS dot would accumulate
    sequentially in fp32 and lose ~1e-4 relative over a million tokens)."""
    return (x * mask).sum()


def _nonempty_rows(row_tokens: torch.Tensor) -> torch.Tensor:
    """Number of sequences with at least one valid token (empty ones do not count)."""
    return (row_tokens > 0).to(row_tokens.dtype).sum()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def agg_seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-sequence token sums; count = non-empty sequences."""
    return _masked_sum(loss, mask), _nonempty_rows(mask.sum(-1))


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def agg_seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-sequence token means; count = non-empty sequences."""
    row_tokens = mask.sum(-1)  # [B]
    per_row = (loss * mask).sum(-1) / row_tokens.clamp(min=1)  # [B]
    return per_row.sum(), _nonempty_rows(row_tokens)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def agg_seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence token sums divided by the constant max response length (Dr. GRPO);
    count = non-empty sequences."""
    return _masked_sum(loss, mask) / max_response_length, _nonempty_rows(mask.sum(-1))


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)`` of a ``[B, R]`` token-loss matrix in aggregation ``mode``."""
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, max_response_length)


# ---- metrics ----------------------------------------------------------------------------
def _token_metric(x: torch.Tensor, mask: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``(sum over valid tokens, n)``; ``n = mask.sum()`` is computed once by the caller."""
    return torch.stack([_masked_sum(x.detach(), mask), n])


def _positive_extremes(
    x: torch.Tensor, mask: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, min)`` metrics of a strictly positive x (ratios) over valid tokens.

    Each is ``(value, 1)``, or ``(0 / inf, 0)`` for a slice without valid tokens (the count 0
    makes the accumulator ignore it). Positivity lets padding drop out as x * 0 = 0 (max) and
    x / 0 = inf (min): no masked_fill, no sync.
    """
    x = x.detach()
    present = (n > 0).to(x.dtype)
    return torch.stack([(x * mask).max(), present]), torch.stack([(x / mask).min(), present])


# ---- LossFn factories -------------------------------------------------------------------
def _require(value: torch.Tensor | None, what: str, why: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"the policy loss needs {what} because {why}")
    return value


class PolicyLossFn:
    """The actor's LossFn: policy loss x TIS weight x MIS mask - entropy bonus + KL term,
    aggregated."""

    def __init__(
        self, cfg: AlgorithmConfig, max_response_length: int, kl_coef: float | None = None
    ) -> None:
        if max_response_length <= 0:
            raise ValueError(f"max_response_length must be positive, got {max_response_length}")
        self.cfg = cfg
        self.max_response_length = max_response_length
        self.kl_coef = cfg.kl.loss_kl_coef if kl_coef is None else kl_coef
        self.policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
        self.aggregation = LOSS_AGGREGATIONS.get(cfg.loss_agg)

    def __call__(
        self, batch: Batch, outputs: ModelOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        cfg, logp = self.cfg, outputs.logprobs  # [b, R]
        mask = batch.response_mask.to(logp.dtype)
        n = mask.sum()
        advantages = _require(
            batch.advantages, "batch.advantages", "it is the policy-gradient signal"
        )
        # without old log-probs the step is on-policy: ratio 1, gradient = REINFORCE's
        old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        terms = self.policy_loss(logp, old, advantages, mask, cfg.clip)
        metrics: dict[str, torch.Tensor] = {
            "actor/clip_frac": _token_metric(terms.clipped, mask, n),
            "actor/clip_frac_lower": _token_metric(terms.clipped_lower, mask, n),
            # -log ratio as the loss clamped it (verl's ppo_kl): finite where a ratio saturates
            "actor/ppo_kl": _token_metric(terms.log_ratio.neg(), mask, n),
            "actor/ratio_mean": _token_metric(terms.ratio, mask, n),
        }
        metrics["actor/ratio_max"], metrics["actor/ratio_min"] = _positive_extremes(terms.ratio, mask, n)
        token_loss = self._importance_weighted(terms.loss, old, logp.detach(), batch, mask, n, metrics)
        total = self._regularised(token_loss, logp, batch, outputs, mask, n, metrics)
        loss_sum, count = self.aggregation(total, mask, self.max_response_length)
        metrics["actor/loss"] = torch.stack([loss_sum.detach(), count.detach()])
        if total is token_loss:  # no extra terms: the policy-gradient loss is the loss
            metrics["actor/pg_loss"] = metrics["actor/loss"]
        else:
            pg_sum, pg_count = self.aggregation(token_loss.detach(), mask, self.max_response_length)
            metrics["actor/pg_loss"] = torch.stack([pg_sum, pg_count])
        return loss_sum, count.detach(), metrics

    def _importance_weighted(
        self,
        loss: torch.Tensor,
        old: torch.Tensor,
        current: torch.Tensor,
        batch: Batch,
        mask: torch.Tensor,
        n: torch.Tensor,
        metrics: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The token losses times the TIS weights and the MIS mask (each when configured), plus
        the mismatch metrics. Both need the engine's log-probs and compare them with ``old``
        (old log-probs when the batch has them, in asynchronous runs the proximal policy; TIS and
        MIS are refused with the engine's as old, where their weight would be 1); ``current``: this
        forward's log-probs, detached."""
        tis, mis = self.cfg.tis, self.cfg.mis
        if batch.rollout_logprobs is not None:
            # old_logprobs=engine: ``old`` is the engine's own, so the gap is taken to the policy
            # being trained (at a step's first mini-batch the trainer's view of the weights that
            # sampled, plus the staleness in asynchronous runs)
            trainer = old if self.cfg.old_logprobs == "recompute" else current
            metrics["rollout/logprob_mismatch"] = logprob_mismatch(
                trainer, batch.rollout_logprobs, mask
            )
        if tis.level != "none":
            rollout = _require(
                batch.rollout_logprobs, "batch.rollout_logprobs", "algorithm.tis.level is set"
            )
            weights = tis_weights(old, rollout, mask, tis.level, tis.cap)  # [b, R]
            metrics["actor/tis_weight"] = _token_metric(weights, mask, n)
            metrics["actor/tis_capped_frac"] = _token_metric(
                tis_capped(old, rollout, mask, tis.level, tis.cap).to(loss.dtype), mask, n
            )
            loss = loss * weights
        if mis.level != "none":
            rollout = _require(
                batch.rollout_logprobs, "batch.rollout_logprobs", "algorithm.mis.level is set"
            )
            keep = mis_mask(old, rollout, mask, mis.level, mis.low, mis.high)  # [b, R] 0/1
            metrics["actor/mis_masked_frac"] = _token_metric(1.0 - keep, mask, n)
            loss = loss * keep  # masked tokens: 0 loss, still counted by the aggregation
        return loss

    def _regularised(
        self,
        loss: torch.Tensor,
        logp: torch.Tensor,
        batch: Batch,
        outputs: ModelOutputs,
        mask: torch.Tensor,
        n: torch.Tensor,
        metrics: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The token losses minus the entropy bonus plus the KL term, as configured. ``actor/kl``
        is emitted empty (reported null) without a reference: the run log always has the key."""
        cfg = self.cfg
        if outputs.entropy is not None:
            metrics["actor/entropy"] = _token_metric(outputs.entropy, mask, n)
        if cfg.entropy_coef > 0:
            entropy = _require(outputs.entropy, "outputs.entropy", "algorithm.entropy_coef > 0")
            loss = loss - cfg.entropy_coef * entropy
        if batch.ref_logprobs is None:
            if cfg.kl.use_in_loss:
                _require(None, "batch.ref_logprobs", "algorithm.kl.use_in_loss is true")
            metrics["actor/kl"] = torch.zeros(2, dtype=n.dtype, device=n.device)  # nothing counted
            return loss
        kl = kl_estimate(logp, batch.ref_logprobs, cfg.kl.loss_kl_estimator)  # [b, R]
        metrics["actor/kl"] = _token_metric(kl, mask, n)
        return loss + self.kl_coef * kl if cfg.kl.use_in_loss else loss


class ValueLossFn:
    """The critic's LossFn: 0.5 * max((v - R)^2, (v_clipped - R)^2), v clipped around the old
    values by ``algorithm.clip.value`` (no clipping when it is None)."""

    def __init__(self, cfg: AlgorithmConfig, max_response_length: int | None = None) -> None:
        if cfg.loss_agg == "seq-mean-token-sum-norm" and not max_response_length:
            raise ValueError(
                "algorithm.loss_agg seq-mean-token-sum-norm needs max_response_length for the value loss"
            )
        self.clip = cfg.clip.value
        self.max_response_length = max_response_length or 1
        self.aggregation = LOSS_AGGREGATIONS.get(cfg.loss_agg)

    def __call__(
        self, batch: Batch, outputs: ModelOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if outputs.values is None or batch.values is None or batch.returns is None:
            raise ValueError(
                "the value loss needs outputs.values, batch.values (old values) and batch.returns"
            )
        vpred, old, returns = outputs.values, batch.values, batch.returns  # [b, R]
        mask = batch.response_mask.to(vpred.dtype)
        err = (vpred - returns).square()
        if self.clip is None:
            token_loss, clipped = 0.5 * err, torch.zeros_like(err)
        else:
            vclipped = old + (vpred - old).clamp(-self.clip, self.clip)
            err_clipped = (vclipped - returns).square()
            token_loss = 0.5 * torch.maximum(err, err_clipped)
            clipped = (err_clipped > err).to(vpred.dtype)
        loss_sum, count = self.aggregation(token_loss, mask, self.max_response_length)
        n = mask.sum()
        vf_loss = torch.stack([loss_sum.detach(), count.detach()])
        metrics = {
            "critic/loss": vf_loss,  # the value loss is the whole critic loss
            "critic/vf_loss": vf_loss,
            "critic/vf_clipfrac": _token_metric(clipped, mask, n),
            "critic/vpred_mean": _token_metric(vpred, mask, n),
        }
        return loss_sum, count.detach(), metrics


class SFTLossFn:
    """Supervised fine-tuning: the negative log-likelihood of the trained tokens
    (``batch.response_mask``), a token mean over the whole optimizer step."""

    def __call__(
        self, batch: Batch, outputs: ModelOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        logp = outputs.logprobs  # [b, R]
        mask = batch.response_mask.to(logp.dtype)
        loss_sum, count = -(logp * mask).sum(), mask.sum()
        metrics = {
            "sft/loss": torch.stack([loss_sum.detach(), count]),
            "sft/tokens": torch.stack([count, torch.ones_like(count)]),
        }
        return loss_sum, count, metrics


def make_policy_loss_fn(
    cfg: AlgorithmConfig, max_response_length: int, kl_coef: float | None = None
) -> LossFn:
    """The actor's LossFn. ``max_response_length`` (rollout.sampling.max_new_tokens) is the
    constant of seq-mean-token-sum-norm; ``kl_coef`` overrides ``cfg.kl.loss_kl_coef`` for the loss term."""
    return PolicyLossFn(cfg, max_response_length, kl_coef)


def make_value_loss_fn(cfg: AlgorithmConfig, max_response_length: int | None = None) -> LossFn:
    """The critic's LossFn (same aggregation as the actor, ``cfg.loss_agg``)."""
    return ValueLossFn(cfg, max_response_length)
