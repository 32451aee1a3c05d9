"""Per-token log-probabilities and entropy straight from the last hidden states, in chunks.

The LM head is where long responses run out of memory: ``[tokens, V/tp]`` logits, in the
model's dtype and again in fp32 (with their softmax and gradient), grow with the vocabulary
times every token of the micro-batch. Here the output layer's matmul and the log-softmax are
one autograd function that walks the tokens ``chunk_tokens`` at a time. The forward keeps,
per token, only its log-normaliser and entropy. The backward recomputes each chunk's logits
from the saved hidden states and weight. So the head's working memory is a few
``[chunk, V/tp]`` fp32 buffers (plus, with several chunks, an fp32 sum of the weight's
gradient), whatever the number of tokens.

Tensor parallelism: each rank holds the rows of its own slice of the (padded) vocabulary,
``weight [V/tp, h]``, columns ``vocab_start .. vocab_start + V/tp``. The full-vocabulary
logits are never gathered. Each rank reduces its slice to a log-sum-exp and a local entropy
per token. One MAX and one SUM all-reduce of ``[tokens]``-sized vectors combine them. Columns
past the real vocabulary (padding so that ``V`` divides by ``tp``) are masked out of every
sum. The hidden states' gradient is summed over the group in the backward, as Megatron's
column-parallel output layer does (``copy_to_tensor_model_parallel_region``).

Log-probs are those of ``log_softmax(logits / T)``, before any top-k/top-p filtering, as the
rollout engine reports them. Under sequence parallelism the hidden states arrive gathered (the
model's position hook gathers them with a backward that only splits). Left out: a fused GPU
kernel (the chunks are plain matmuls), and adding the weight's gradient straight into
Megatron's fp32 ``main_grad`` (as its gradient-accumulation fusion does), which would save the
fp32 sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _Vocab:
    """This rank's slice of the vocabulary and how one chunk's logits are made."""

    def __init__(self, weight: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int | None) -> None:
        self.weight = weight  # [Vl, h]
        self.temperature = temperature
        self.start = vocab_start
        local = weight.shape[0]
        self.pad = None  # [Vl] bool, True at padding columns
        if vocab_size is not None and vocab_start + local > vocab_size:
            assert vocab_start < vocab_size, "a vocabulary slice holds only padding"
            self.pad = torch.arange(vocab_start, vocab_start + local, device=weight.device) >= vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[c, Vl]`` fp32 ``logits / T`` of ``hidden [c, h]``, -inf at padding columns (a new
        tensor, free to change in place). The matmul runs in the model's dtype, as the output
        layer's does."""
        z = (hidden @ self.weight.t()).float().div_(self.temperature)
        return z if self.pad is None else z.masked_fill_(self.pad, float("-inf"))

    def finite_(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` with padding columns set to 0, in place (so that ``p * z`` is 0 there, not nan)."""
        return z if self.pad is None else z.masked_fill_(self.pad, 0.0)

    def owned(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local column [c], owned [c] bool)`` of each target id on this rank."""
        local = targets - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        return local.clamp(0, self.weight.shape[0] - 1), owned


def _local_stats(vocab: _Vocab, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, with_entropy: bool):
    """This rank's per-token ``(log-sum-exp [N], entropy of its own slice [N] | None, target
    logit [N] (0 where another rank owns the target))``, ``chunk`` tokens at a time."""
    n = hidden.shape[0]
    lse = hidden.new_empty(n, dtype=torch.float32)
    local_h = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
    picked = hidden.new_zeros(n, dtype=torch.float32)
    for s in range(0, n, chunk):
        e = s + chunk
        z = vocab.logits(hidden[s:e])  # [c, Vl]
        lse[s:e] = torch.logsumexp(z, dim=-1)
        col, owned = vocab.owned(targets[s:e])
        picked[s:e] = torch.where(owned, z.gather(-1, col[:, None])[:, 0], 0.0)
        if local_h is not None:
            logp = vocab.finite_(z.sub_(lse[s:e, None]))  # [c, Vl] this slice's own log-softmax
            local_h[s:e] = -logp.exp().mul_(logp).sum(-1)  # no cancellation: logp <= 0
    return lse, local_h, picked


def _combine(lse_r: torch.Tensor, h_r: torch.Tensor | None, picked: torch.Tensor, group):
    """The whole vocabulary's ``(logprobs, log-normaliser, entropy | None)`` [N] from each
    rank's slice: with ``e_r = exp(lse_r - M)``, ``lse = M + log sum e_r`` and
    ``H = log sum e_r - sum e_r (lse_r - M - H_r) / sum e_r`` (H = lse - E[z], E[z] the
    e-weighted mean of each slice's ``lse_r - H_r``); everything stays near 0 around M."""
    if _group_size(group) == 1:
        return picked - lse_r, lse_r, h_r
    m = lse_r.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = (lse_r - m).exp()
    parts = [e, picked] + ([e * (lse_r - m - h_r)] if h_r is not None else [])
    sums = torch.stack(parts)  # [2 or 3, N]
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    log_s = sums[0].log()
    lse = m + log_s
    entropy = log_s - sums[2] / sums[0] if h_r is not None else None
    return sums[1] - lse, lse, entropy


class _LinearLogprobs(torch.autograd.Function):
    """``(logprobs [N], entropy [N] | None)`` of ``targets`` under ``softmax(hidden @ W^T / T)``
    over the group's vocabulary, differentiable in ``hidden`` and ``weight``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, vocab_size, group, chunk, with_entropy):
        vocab = _Vocab(weight, temperature, vocab_start, vocab_size)
        lse_r, h_r, picked = _local_stats(vocab, hidden, targets, chunk, with_entropy)
        logprobs, lse, entropy = _combine(lse_r, h_r, picked, group)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if entropy is not None else lse)
        ctx.args = (temperature, vocab_start, vocab_size, group, chunk, with_entropy)
        # An unused output's gradient stays None (not zeros): the entropy is often a metric only,
        # and its term is the costliest of the backward.
        ctx.set_materialize_grads(False)
        if entropy is None:
            return logprobs, logprobs.new_zeros(0)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, group, chunk, with_entropy = ctx.args
        vocab = _Vocab(weight, temperature, vocab_start, vocab_size)
        n = hidden.shape[0]
        # The chain rule through logits / T, on [N] rather than [N, Vl].
        grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp / temperature
        grad_h = grad_h / temperature if with_entropy and grad_h is not None else None
        grad_hidden = torch.empty_like(hidden)  # [N, h]
        # Several chunks' weight gradients add up in at least fp32 (each chunk's product is
        # rounded to the weights' dtype first; a bf16 model's gradient gets one more rounding).
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        summed = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if n > chunk else None
        grad_weight = None  # [Vl, h]
        for s in range(0, n, chunk):
            e = s + chunk
            g = _chunk_grad(vocab, hidden[s:e], targets[s:e], lse[s:e], entropy[s:e], grad_lp[s:e],
                            None if grad_h is None else grad_h[s:e]).to(weight.dtype)  # [c, Vl] raw logits' gradient
            grad_hidden[s:e] = g @ weight
            if summed is None:
                grad_weight = g.t() @ hidden[s:e]
            elif weight.dtype == acc_dtype:  # addmm_ needs one dtype; it saves a [Vl, h] temporary
                summed.addmm_(g.t(), hidden[s:e])
            else:
                summed += g.t() @ hidden[s:e]
        if summed is not None:
            grad_weight = summed.to(weight.dtype)
        elif grad_weight is None:  # no real response token in this micro-batch
            grad_weight = torch.zeros_like(weight)
        if _group_size(group) > 1:  # each rank back-propagated its own vocabulary slice
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _chunk_grad(vocab: _Vocab, hidden, targets, lse, entropy, grad_lp, grad_h) -> torch.Tensor:
    """``[c, Vl]`` fp32 gradient w.r.t. the raw logits of one chunk, from ``grad_lp`` and
    ``grad_h`` already divided by T: d logp_t / dz_j = [j = t] - p_j and dH / dz_j =
    -p_j (log p_j + H). Two ``[c, Vl]`` buffers, changed in place."""
    logp = vocab.logits(hidden).sub_(lse[:, None])  # global log-probs of this slice, -inf at padding
    p = logp.exp()
    if grad_h is not None:  # p (log p + H) gH, in the log-probs' buffer
        entropy_term = vocab.finite_(logp).add_(entropy[:, None]).mul_(p).mul_(grad_h[:, None])
    g = p.mul_(-grad_lp[:, None])
    col, owned = vocab.owned(targets)
    g.scatter_add_(-1, col[:, None], torch.where(owned, grad_lp, 0.0)[:, None])
    return g.sub_(entropy_term) if grad_h is not None else g


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (and entropy) under ``softmax(hidden @ weight^T / temperature)``.

    Args:
        hidden: ``[N, h]`` the last hidden states that predict ``targets`` (model dtype).
        weight: ``[Vl, h]`` this rank's rows of the output layer, vocabulary ids
            ``vocab_start .. vocab_start + Vl`` of the padded vocabulary.
        targets: ``[N]`` long, token ids in the full vocabulary.
        temperature: divides the logits (must be > 0).
        vocab_size: the real vocabulary size; ids at or past it are padding and are masked.
            None = no padding.
        group: the tensor-parallel process group (None or size 1 = the whole vocabulary is here).
        chunk_tokens: tokens whose logits exist at once (bounds the head's memory).
        with_entropy: also return the per-token entropy ``-sum p log p``.

    Returns:
        ``(logprobs [N], entropy [N] | None)`` in float32, identical on every rank of the group.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logprobs, entropy = _LinearLogprobs.apply(
        hidden, weight, targets, temperature, vocab_start, vocab_size, group, chunk_tokens, with_entropy
    )
    return logprobs, (entropy if with_entropy else None)
