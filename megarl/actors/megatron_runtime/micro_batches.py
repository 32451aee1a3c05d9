"""Splitting a batch across data-parallel ranks and into micro-batches, and laying rows out.

Three pure steps, no process groups involved:

1. ``balanced_partition``: the samples of a (mini-)batch are dealt to the DP ranks so that
   every rank gets (almost) the same number of samples and a similar number of tokens
   (greedy longest-first: each sample goes to the least-loaded rank that still has room).
2. ``micro_batch_indices``: a rank's samples are cut into micro-batches, either a fixed number
   of samples each, or as many as fit a token budget (``rows x longest row <= max_tokens``,
   since a micro-batch is padded to its longest row). Samples are sorted by length first, so
   rows of similar length share a micro-batch and little padding is computed.
3. ``pack_micro_batch``: the rows of a micro-batch are laid out left-aligned: each row is its
   real prompt tokens followed by its real response tokens, starting at column 0, right-padded
   to the longest row. Position ids are then plain ``0..S-1`` and plain causal attention is
   exact for every row (padding only ever follows real tokens), so no mask is built. The
   micro-batch lists its real response tokens (row ``i``, step ``t``, flattened) and the
   column whose output predicts each: ``prompt_len_i + t - 1`` of row ``i``. Only these
   positions reach the output layer; padding past a response's end never does. The lists are
   made on the host, so nothing waits on the device to find them.

What is left out: sequence packing (THD), which the CPU attention path does not support.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from megarl.data.batch import Batch


def balanced_partition(weights: list[int], parts: int) -> list[list[int]]:
    """Deal items to ``parts`` bins of at most ``ceil(n / parts)`` items, balancing total weight.

    Returns ``parts`` lists of item indices (each sorted ascending). Greedy longest-first: the
    heaviest remaining item goes to the lightest bin that still has room.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    n = len(weights)
    capacity = -(-n // parts)
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, p) for p in range(parts)]  # (load, bin)
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    for i in order:
        full: list[tuple[int, int]] = []
        load, p = heapq.heappop(heap)
        while len(bins[p]) >= capacity:
            full.append((load, p))
            load, p = heapq.heappop(heap)
        bins[p].append(i)
        heapq.heappush(heap, (load + weights[i], p))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(b) for b in bins]


def micro_batch_indices(
    lengths: list[int], *, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> list[list[int]]:
    """Cut items (with their sequence ``lengths``) into micro-batches of positions into ``lengths``.

    ``max_tokens`` (takes precedence): a micro-batch holds rows while ``rows x longest <=
    max_tokens``; a row longer than the budget gets a micro-batch of its own.
    ``micro_batch_size``: fixed number of rows per micro-batch (the last may be smaller).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens_per_gpu must be positive, got {max_tokens}")
        groups: list[list[int]] = []
        for i in order:
            # Sorted longest first, so the first row of a group is its longest.
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(
            f"set micro_batch_size (a positive number of samples) or max_tokens_per_gpu, got {micro_batch_size}"
        )
    return [order[k : k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """[B] real tokens per row: prompt plus response."""
    return batch.prompt_lengths + batch.response_lengths


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a batch laid out left-aligned for the model (see the module docstring)."""

    rows: torch.Tensor  # [b] long, row indices into the batch this micro-batch came from
    batch: Batch  # the rows themselves (fields as in the original batch), for the loss function
    tokens: torch.Tensor  # [b, S] long, real tokens from column 0, right-padded with 0
    position_ids: torch.Tensor  # [b, S] long, 0..S-1
    # The n real response tokens (t < response length), row-major:
    token_rows: torch.Tensor  # [n] long, row i of each
    token_columns: torch.Tensor  # [n] long, the column whose output predicts it
    token_index: torch.Tensor  # [n] long, i * R + t: its place in a [b, R] tensor

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, R]`` with ``values [n]`` (one per real response token) in place, 0 elsewhere;
        differentiable in ``values``."""
        b, r = self.batch.response_ids.shape
        return values.new_zeros(b * r).index_copy(0, self.token_index, values).view(b, r)

    def token_targets(self) -> torch.Tensor:
        """``[n]`` the ids of the real response tokens (what ``token_columns`` predict)."""
        return self.batch.response_ids.flatten()[self.token_index]


def pack_micro_batch(
    batch: Batch, rows: list[int] | torch.Tensor, device: torch.device | str = "cpu", width_multiple: int = 1
) -> MicroBatch:
    """Lay out ``rows`` of ``batch`` left-aligned (prompt then response) on ``device``; the
    width is rounded up to ``width_multiple`` (sequence parallelism splits it over TP ranks)."""
    rows_t = torch.as_tensor(rows, dtype=torch.long)
    sub = batch.select(rows_t)
    plen = sub.prompt_lengths  # [b]
    rlen = sub.response_lengths  # [b]
    total = plen + rlen
    width = -(-max(int(total.max()), 1) // width_multiple) * width_multiple
    b, p = sub.prompt_ids.shape
    r = sub.response_len
    tokens = torch.zeros(b, width, dtype=torch.long)
    for i in range(b):
        pl, rl = int(plen[i]), int(rlen[i])
        # Left-padded prompt: its real tokens are the last pl columns.
        tokens[i, :pl] = sub.prompt_ids[i, p - pl :]
        tokens[i, pl : pl + rl] = sub.response_ids[i, :rl]
    # Column of the logits that predict response token t. t = 0 of an empty prompt has none
    # (clamped to column 0); both engines refuse empty prompts, so it never reaches the loss.
    columns = (plen[:, None] + torch.arange(r)[None, :] - 1).clamp(0, width - 1)  # [b, R]
    real = torch.arange(r)[None, :] < rlen[:, None]  # [b, R]
    token_rows, steps = real.nonzero(as_tuple=True)  # [n] each, row-major (on the host)
    positions = torch.arange(width, dtype=torch.long)[None, :].expand(b, width).contiguous()
    return MicroBatch(
        rows=rows_t,
        batch=sub.to(device),
        tokens=tokens.to(device),
        position_ids=positions.to(device),
        token_rows=token_rows.to(device),
        token_columns=columns[token_rows, steps].to(device),
        token_index=(token_rows * r + steps).to(device),
    )
