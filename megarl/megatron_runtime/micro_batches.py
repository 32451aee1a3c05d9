"""Splitting a batch across data-parallel ranks and into micro-batches, and laying rows out.

Pure steps, no process groups involved:

1. ``balanced_partition``: the samples of a (mini-)batch are dealt to the DP ranks so that
   every rank gets (almost) the same number of samples and a similar number of tokens
   (greedy longest-first: each sample goes to the least-loaded rank that still has room).
2. ``micro_batch_indices``: a rank's samples are cut into micro-batches, either a fixed number
   of samples each, or as many as fit a token budget. Packed, the budget counts real tokens
   (first-fit-decreasing: each sample, longest first, goes into the first micro-batch with
   room); padded, it counts ``rows x longest row``, since a padded micro-batch is as wide as
   its longest row. Samples are sorted by length first, so padded rows of similar length
   share a micro-batch.
3. ``pack_micro_batch``: the rows of a micro-batch are laid out one of two ways.
   Packed (``MicroBatching.packed``, the default): the rows follow each other in ONE sequence
   ``[1, T]`` (THD for Megatron: ``T`` real tokens, rounded up to a multiple of TP under
   sequence parallelism by a trailing padding segment), position ids restart at 0 in each
   row, and the attention keeps every row to itself (``megarl.models.packed_sequences``).
   Padded: each row starts at column 0 of its own line ``[b, S]``, right-padded to the
   longest row; position ids are ``0..S-1`` and plain causal attention is exact for every row
   (padding only ever follows real tokens), so no mask is built.
   Either way a row is its real prompt tokens followed by its real response tokens, and the
   micro-batch lists its real response tokens (row ``i``, step ``t``, flattened) with the
   line and column whose output predicts each: ``start_i + prompt_len_i + t - 1``, where
   ``start_i`` is the row's offset in the packed sequence (0 when padded). Only these
   positions reach the output layer. The lists are made on the host, so nothing waits on the
   device to find them.

In training, every DP replica runs the same number of micro-batches (``equal_counts``): all
ranks hold the same batch, so each computes every replica's count itself (no communication),
and a replica with fewer runs filler micro-batches (its shortest row, with loss weight 0).
This is insurance, not a fix: nothing megarl runs today exchanges data over DP per
micro-batch (gradients are reduced once per mini-batch, after the last micro-batch), but
per-micro-batch DP collectives (the distributed optimizer's overlapped parameter gather,
expert all-to-all) assume equal counts and would hang without. Forward passes skip it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megarl.config.train_sections import ActorConfig
from megarl.data.batch import Batch
from megarl.models.packed_sequences import PackedLayout


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


def mini_batches(batch: Batch, size: int, epochs: int, shuffle_seed: int | None = None) -> Iterator[Batch]:
    """The optimizer steps' mini-batches: ``epochs`` passes over ``batch`` in chunks of ``size``.

    ``shuffle_seed`` None: consecutive chunks in the batch's order. Else each pass first permutes
    the rows, passes drawing successive permutations from one generator seeded with it, so every
    rank (each holds the whole batch and takes its share of a mini-batch by index) cuts the same
    mini-batches, and the same seed always cuts them the same way."""
    for rows in mini_batch_rows(len(batch), size, epochs, shuffle_seed):
        yield batch.select(rows)


def mini_batch_rows(count: int, size: int, epochs: int, shuffle_seed: int | None = None) -> Iterator[list[int]]:
    """The rows (indices into a batch of ``count``) of each of :func:`mini_batches`' mini-batches."""
    generator = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    for _ in range(epochs):
        order = list(range(count)) if generator is None else torch.randperm(count, generator=generator).tolist()
        yield from (order[i : i + size] for i in range(0, count, size))


def replica_rows(batch: Batch, dp_size: int, mini_batches_rows: Sequence[list[int]] = ()) -> list[list[int]]:
    """The rows of ``batch`` each data-parallel replica runs, as the ranks split them: its
    ``balanced_partition`` share of the whole batch (a forward: log-probs, the replay metrics'
    passes) and of each mini-batch in ``mini_batches_rows`` (an update; :func:`mini_batch_rows`).
    The controller sends each replica the routing of these rows only (Batch.routing_share)."""
    lengths = sequence_lengths(batch).tolist()
    held: list[set[int]] = [set() for _ in range(dp_size)]
    for rows in [list(range(len(batch))), *mini_batches_rows]:
        if len(rows) < dp_size:  # the rank refuses it (replica_groups), with the reason
            return [list(range(len(batch)))] * dp_size
        for d, share in enumerate(balanced_partition([lengths[r] for r in rows], dp_size)):
            held[d].update(rows[i] for i in share)
    return [sorted(h) for h in held]


def micro_batch_indices(
    lengths: list[int], *, micro_batch_size: int | None = None, max_tokens: int | None = None, packed: bool = False
) -> list[list[int]]:
    """Cut items (with their sequence ``lengths``) into micro-batches of positions into ``lengths``.

    ``max_tokens`` (takes precedence): packed, a micro-batch holds rows while their tokens add
    up to at most ``max_tokens`` (first-fit-decreasing); padded, while ``rows x longest <=
    max_tokens``. A row longer than the budget gets a micro-batch of its own.
    ``micro_batch_size``: fixed number of rows per micro-batch (the last may be smaller).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens_per_gpu must be positive, got {max_tokens}")
        return _first_fit(lengths, order, max_tokens) if packed else _by_widest(lengths, order, max_tokens)
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(
            f"set micro_batch_size (a positive number of samples) or max_tokens_per_gpu, got {micro_batch_size}"
        )
    return [order[k : k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]


def _first_fit(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing: each item (longest first) joins the first group with room."""
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return groups


def _by_widest(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive items (longest first) while ``rows x longest <= max_tokens``."""
    groups: list[list[int]] = []
    for i in order:
        # Sorted longest first, so the first row of a group is its longest.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class MicroBatching:
    """How a worker cuts its share of a batch into micro-batches (from its config section)."""

    micro_batch_size: int | None
    max_tokens: int | None
    packed: bool

    @classmethod
    def of(cls, cfg: ActorConfig) -> MicroBatching:
        """The update's micro-batches."""
        return cls(cfg.micro_batch_size, cfg.max_tokens_per_gpu, cfg.pack_sequences)

    @classmethod
    def forward_only(cls, cfg: ActorConfig) -> MicroBatching:
        """The forward-only passes' micro-batches (log-probs, values): ``logprob_max_tokens_per_gpu``,
        else ``logprob_micro_batch_size``, else the update's (:meth:`of`)."""
        if cfg.logprob_max_tokens_per_gpu is not None:
            return cls(None, cfg.logprob_max_tokens_per_gpu, cfg.pack_sequences)
        if cfg.logprob_micro_batch_size is not None:
            return cls(cfg.logprob_micro_batch_size, None, cfg.pack_sequences)
        return cls.of(cfg)

    def replica_groups(self, batch: Batch, dp_size: int) -> list[list[list[int]]]:
        """Row groups (indices into ``batch``) of every DP replica: ``dp_size`` lists of groups,
        rows dealt by ``balanced_partition`` and cut by ``micro_batch_indices``."""
        if len(batch) < dp_size:
            raise ValueError(
                f"a batch of {len(batch)} samples cannot be spread over {dp_size} data-parallel "
                f"ranks; use at least {dp_size} samples per mini-batch"
            )
        lengths = sequence_lengths(batch).tolist()
        replicas = []
        for rows in balanced_partition(lengths, dp_size):
            cut = micro_batch_indices([lengths[r] for r in rows], micro_batch_size=self.micro_batch_size,
                                      max_tokens=self.max_tokens, packed=self.packed)  # fmt: skip
            replicas.append([[rows[i] for i in g] for g in cut])
        return replicas


def equal_counts(replicas: list[list[list[int]]], replica: int, lengths: list[int]) -> tuple[list[list[int]], int]:
    """Fillers up to the largest count of any replica, then ``replica``'s groups; and how many
    fillers lead. A filler is the replica's shortest row again (cheapest to run); its loss weight
    must be 0, and it must still reach every parameter (Megatron's DDP checks, from the second
    step on, that the last micro-batch's backward readies the same parameters as the first
    step's did: fillers go first so that the last micro-batch is always a real one)."""
    own = replicas[replica]
    fillers = max(len(r) for r in replicas) - len(own)
    shortest = min((r for g in own for r in g), key=lambda r: lengths[r])
    return [[shortest]] * fillers + own, fillers


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """[B] real tokens per row: prompt plus response."""
    return batch.prompt_lengths + batch.response_lengths


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a batch laid out for the model, packed or padded (see the module docstring)."""

    rows: torch.Tensor  # [b] long, row indices into the batch this micro-batch came from
    batch: Batch  # the rows themselves (fields as in the original batch), for the loss function
    tokens: torch.Tensor  # packed [1, T] / padded [b, S] long: real tokens, padding 0
    position_ids: torch.Tensor  # same shape: position within the row
    # The n real response tokens (t < response length), row-major:
    token_rows: torch.Tensor  # [n] long, the line of tokens holding it (always 0 when packed)
    token_columns: torch.Tensor  # [n] long, the column whose output predicts it
    token_index: torch.Tensor  # [n] long, i * R + t: its place in a [b, R] tensor
    layout: PackedLayout | None = None  # the segments of the packed sequence; None when padded
    filler: bool = False  # run only to keep DP replicas in step: loss weight 0, outputs dropped

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, R]`` with ``values [n]`` (one per real response token) in place, 0 elsewhere;
        differentiable in ``values``."""
        b, r = self.batch.response_ids.shape
        return values.new_zeros(b * r).index_copy(0, self.token_index, values).view(b, r)

    def token_targets(self) -> torch.Tensor:
        """``[n]`` the ids of the real response tokens (what ``token_columns`` predict)."""
        return self.batch.response_ids.flatten()[self.token_index]


def pack_micro_batch(
    batch: Batch,
    rows: list[int] | torch.Tensor,
    device: torch.device | str = "cpu",
    width_multiple: int = 1,
    *,
    packed: bool = False,
    filler: bool = False,
) -> MicroBatch:
    """Lay out ``rows`` of ``batch`` (prompt then response) on ``device``, as one packed sequence
    or as right-padded lines; the length (packed) or width (padded) is rounded up to
    ``width_multiple`` (sequence parallelism splits it over TP ranks)."""
    rows_t = torch.as_tensor(rows, dtype=torch.long)
    sub = batch.select(rows_t)
    plen, rlen = sub.prompt_lengths, sub.response_lengths  # [b] each
    p, r = sub.prompt_ids.shape[1], sub.response_len
    real_rows = [torch.cat([sub.prompt_ids[i, p - int(plen[i]) :], sub.response_ids[i, : int(rlen[i])]])
                 for i in range(len(rows_t))]  # fmt: skip  (a left-padded prompt's real tokens are its last ones)
    lengths = [len(t) for t in real_rows]
    real = torch.arange(r)[None, :] < rlen[:, None]  # [b, R]
    token_rows, steps = real.nonzero(as_tuple=True)  # [n] each, row-major (on the host)
    # Column predicting response token t: the row's start, then prompt_len + t - 1. t = 0 of an
    # empty prompt has none (clamped); both engines refuse empty prompts, so it never reaches the loss.
    if packed:
        total = sum(lengths)
        pad = -total % width_multiple
        layout = PackedLayout.build(lengths + ([pad] if pad else []), device)
        tokens = torch.cat([*real_rows, torch.zeros(pad, dtype=torch.long)])[None, :]  # [1, T]
        positions = layout.positions()[None, :]  # [1, T]
        starts = torch.tensor(layout.starts[: len(real_rows)])  # [b] each row's offset
        columns = starts[token_rows] + (plen[token_rows] + steps - 1).clamp(min=0)
        line = torch.zeros_like(token_rows)
    else:
        layout = None
        width = -(-max(max(lengths), 1) // width_multiple) * width_multiple
        tokens = torch.zeros(len(real_rows), width, dtype=torch.long)  # [b, S]
        for i, t in enumerate(real_rows):
            tokens[i, : len(t)] = t
        positions = torch.arange(width, dtype=torch.long)[None, :].expand(len(real_rows), width).contiguous()
        columns = (plen[token_rows] + steps - 1).clamp(0, width - 1)
        line = token_rows
    return MicroBatch(
        rows=rows_t,
        batch=sub.to(device),
        tokens=tokens.to(device),
        position_ids=positions.to(device),
        token_rows=line.to(device),
        token_columns=columns.to(device),
        token_index=(token_rows * r + steps).to(device),
        layout=layout,
        filler=filler,
    )
