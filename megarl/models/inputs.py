"""Inputs a Megatron GPTModel stage expects, built from padded token batches; vocab padding.

GPTModel.forward(input_ids, position_ids, attention_mask) with ``attention_mask`` bool
``[b, 1, s, s]``, True = masked (causal + padding). RoPE in Megatron's GPTModel uses the
absolute index in the padded row, not ``position_ids``; that is exact for left- or
right-padded rows because attention scores depend only on relative positions and padding
keys are masked. ``position_ids`` are still passed (the HF convention, cumsum of the valid
mask) for learned position embeddings and for symmetry with the rollout engine.
"""

from __future__ import annotations

import torch


def gpt_inputs(
    input_ids: torch.Tensor,  # [b, s]
    valid: torch.Tensor,  # [b, s] bool/int, 1 = a real token (left or right padding)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [b, s], position_ids [b, s], attention_mask bool [b, 1, s, s], True = masked)."""
    valid = valid.to(torch.bool)
    s = input_ids.shape[1]
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
    attention_mask = causal[None, None] | ~valid[:, None, None, :]
    return input_ids, position_ids, attention_mask


def mask_vocab_padding_(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Fill, in place, the columns of this TP rank's vocab-parallel logits shard ``[..., V/tp]``
    whose global index is >= ``vocab_size`` (vocabulary padding) with the dtype's lowest value,
    so softmax gives them 0 probability and ``p * logits`` (entropy) stays finite, where -inf
    would give NaN. Returns ``logits``."""
    width = logits.shape[-1]
    first_pad = vocab_size - tp_rank * width  # local index of the first padded column
    if first_pad < width:
        logits[..., max(first_pad, 0):] = torch.finfo(logits.dtype).min
    return logits
