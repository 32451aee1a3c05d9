"""Policy and value losses: the LossFn contract shared with the Megatron workers.

Megatron runs with ``calculate_per_token_loss=True``: a loss function returns the *sum* of its
loss over the micro-batch and the count it should be normalised by; Megatron adds both over
micro-batches and data-parallel ranks and divides once. So token-mean counts valid tokens and
the seq-mean modes count sequences, and the normalisation is global across the mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

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
        token-mean, sequences for seq-mean modes); ``metrics``: name -> a detached tensor
        ``[2] = (sum, count)`` over the slice; the worker adds sums and counts over
        micro-batches and DP ranks and reports ``sum / count``.
        """
        ...
