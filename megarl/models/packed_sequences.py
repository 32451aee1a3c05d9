"""Several sequences in one: the layout of a packed (THD) micro-batch and how its attention runs.

A packed micro-batch is one sequence of ``T`` tokens made of segments (the rows, then at most
one padding segment that rounds ``T`` up for sequence parallelism). Each segment must attend
only to itself, with positions restarting at 0. Megatron describes the segments to its layers
with ``cu_seqlens`` (``[k + 1]`` int32 offsets) in ``PackedSeqParams``; rotary embeddings
restart per segment (one row per token: megarl/models/packed_rope.py).

The exact attention path (``megarl.models.attention`` on CPU or in fp32) needs more than
``cu_seqlens``, so :class:`PackedLayout` also holds a plan, made on the host on first use (the
CUDA kernels and FlexAttention need only ``cu_seqlens``): the segments are put in groups of similar length (:func:`group_segments`), and each group is
attended as one right-padded batch ``[n, L]`` with plain causal attention. That is exact for
every real token, for the same reason as in a padded micro-batch: padding only ever follows a
segment's real tokens, so no real query sees it. A group pays ``n x L^2`` attention for the
``sum(l^2)`` its segments need; ``slack`` bounds that ratio, so a long segment is attended
alone and short ones share one call. Everything else (the linear layers, norms, the LM head)
runs on the ``T`` real tokens only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP_SLACK = 1.5  # a group may compute at most this many times the attention its segments need


def group_segments(lengths: list[int], slack: float = GROUP_SLACK) -> list[list[int]]:
    """Indices of ``lengths`` in groups attended together: longest first, a segment joins the
    current group while ``size x longest^2 <= slack x sum(length^2)`` still holds."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    squares = 0
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * longest**2 <= slack * (squares + lengths[i] ** 2):
                groups[-1].append(i)
                squares += lengths[i] ** 2
                continue
        groups.append([i])
        squares = lengths[i] ** 2
    return groups


@dataclass(frozen=True)
class SegmentGroup:
    """Segments attended as one right-padded batch ``[n, L]`` (see the module docstring)."""

    gather: torch.Tensor  # [n, L] long: packed position of (segment, step); past a segment's end, its last token
    real: torch.Tensor  # [m] long: places in the flattened [n * L] that hold real tokens
    scatter: torch.Tensor  # [m] long: the packed positions of those real tokens (same order)


@dataclass(frozen=True)
class PackedLayout:
    """The segments of one packed sequence, on the device the model runs on."""

    lengths: tuple[int, ...]  # tokens per segment, host
    starts: tuple[int, ...]  # each segment's first position, host
    cu_seqlens: torch.Tensor  # [k + 1] int32 on the model's device: segment offsets, 0 .. T
    cu_seqlens_host: torch.Tensor  # the same on the host (Megatron's unfused THD rope reads it with .tolist())

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @classmethod
    def build(cls, lengths: list[int], device: torch.device | str = "cpu") -> PackedLayout:
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"a packed sequence needs segments of at least one token, got lengths {lengths}")
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        host = torch.tensor(starts, dtype=torch.int32)
        return cls(tuple(lengths), tuple(starts[:-1]), host.to(device), host)

    @functools.cached_property
    def groups(self) -> tuple[SegmentGroup, ...]:
        """The padded-batch plan of the exact attention path, made (and copied to the device) on
        first use: the varlen kernel and FlexAttention need only the offsets."""
        groups, device = [], self.cu_seqlens.device
        for members in group_segments(list(self.lengths)):
            width = self.lengths[members[0]]  # longest first
            steps = torch.arange(width)  # [L]
            seg_len = torch.tensor([self.lengths[i] for i in members])  # [n]
            seg_start = torch.tensor([self.starts[i] for i in members])  # [n]
            gather = seg_start[:, None] + torch.minimum(steps[None, :], seg_len[:, None] - 1)  # [n, L]
            valid = (steps[None, :] < seg_len[:, None]).flatten()  # [n * L]
            real = valid.nonzero(as_tuple=True)[0]  # [m]
            groups.append(SegmentGroup(gather.to(device), real.to(device), gather.flatten()[real].to(device)))
        return tuple(groups)

    @functools.cached_property
    def scatter(self) -> torch.Tensor:
        """``[T]`` long: the groups' scatter positions end to end (a permutation of 0..T-1)."""
        return torch.cat([g.scatter for g in self.groups])

    def positions(self) -> torch.Tensor:
        """``[T]`` long: each token's position within its segment (0 at every segment start)."""
        return torch.cat([torch.arange(n) for n in self.lengths])

    @functools.cached_property
    def token_positions(self) -> torch.Tensor:
        """``[T]`` long: :meth:`positions` on the layout's device, made once (the rotary
        embedding's rows, megarl/models/packed_rope.py)."""
        return self.positions().to(self.cu_seqlens.device)
