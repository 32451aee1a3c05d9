"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

With tensor parallelism each rank holds the logits of its own slice of the (padded)
vocabulary, ``[..., V/tp]``. The full-vocabulary logits are never gathered: the softmax
normaliser is built from a max and two sums reduced over the tensor-parallel group, and only
the sampled tokens' logits are picked out (on the rank that owns them) and summed across the
group. Columns past the real vocabulary (padding added so that ``V`` divides by ``tp``) are
masked out of every sum.

Everything is differentiable: the sums use an all-reduce whose backward is the identity, the
same rule Megatron uses for replicated outputs of tensor-parallel layers (every rank holds the
same loss and back-propagates it through its own slice). The max is a constant shift and
carries no gradient.

Deliberately left out: sequence packing, top-k/top-p filtering (log-probs are those of
``log_softmax(logits / T)``, before any filtering, as the rollout engine reports them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """Sum over ``group`` in the forward pass; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _sum_over(tensor: torch.Tensor, group) -> torch.Tensor:
    if _group_size(group) == 1:
        return tensor
    return _AllReduceSumIdentityGrad.apply(tensor, group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (and entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., Vl]`` this rank's slice of the vocabulary, columns
            ``vocab_start .. vocab_start + Vl`` of the padded vocabulary.
        targets: ``[...]`` long, token ids in the full vocabulary.
        temperature: divides the logits (must be > 0).
        vocab_size: the real vocabulary size; columns at or past it are padding and are masked.
            None = no padding.
        group: the tensor-parallel process group (None or size 1 = the whole vocabulary is here).
        with_entropy: also return the per-token entropy ``-sum p log p``.

    Returns:
        ``(logprobs [...], entropy [...] | None)`` in float32, identical on every rank of the group.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    z = logits.float() / temperature  # [..., Vl]
    local_vocab = z.shape[-1]
    pad_mask = None
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        cols = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device)
        pad_mask = cols >= vocab_size  # [Vl]
        z = z.masked_fill(pad_mask, float("-inf"))

    # A global max over the group keeps exp() finite; it is a constant shift (no gradient).
    with torch.no_grad():
        zmax = z.max(dim=-1, keepdim=True).values  # [..., 1]
        if _group_size(group) > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    z = z - zmax
    exp_z = z.exp()  # [..., Vl], 0 at padded columns
    sum_exp = _sum_over(exp_z.sum(dim=-1), group)  # [...]
    log_norm = sum_exp.log()

    # The sampled token's logit lives on exactly one rank; the others contribute 0.
    local_ids = targets - vocab_start
    owned = (local_ids >= 0) & (local_ids < local_vocab)
    picked = z.gather(-1, local_ids.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    logprobs = _sum_over(picked, group) - log_norm

    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v z_v, with padded columns (p = 0, z = -inf) left out.
        z_finite = z if pad_mask is None else z.masked_fill(pad_mask, 0.0)
        weighted = (exp_z * z_finite).sum(dim=-1)  # [...]
        entropy = log_norm - _sum_over(weighted, group) / sum_exp
    return logprobs, entropy
