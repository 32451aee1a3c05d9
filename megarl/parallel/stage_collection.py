"""Collect the pipeline stages' exported tensors onto the ranks that load them.

An export (megarl/models/bridge.py) makes, on every rank of a pipeline stage, the full
(TP-gathered) HF tensors of that stage's layers. Which ranks need the *other* stages' tensors
depends on where the engines read them; :data:`Collect` names the three cases, and each moves
the fewest bytes that case allows:

==========  =================================  ==================================================
collect     ranks that receive every tensor    transfers between stages
==========  =================================  ==================================================
``stage``   none (each stage yields its own)   none: a transport that sends per stage
                                               (``distributed``)
``leader``  the replica's leader (pp 0, tp 0)  TP rank 0 of each other stage sends its tensors to
                                               the leader, point to point (``in_process``: the
                                               torch engine lives there; ``disk``: rank 0 writes)
``all``     every rank                         TP rank t of the sending stage broadcasts the t-th
                                               slice of each tensor over its PP group, and the
                                               receiving stage's TP group all-gathers the slices
                                               (``tensor``: each GPU feeds one TP rank of a
                                               colocated engine, which loads whole tensors)
==========  =================================  ==================================================

With ``all`` a tensor crosses the stage boundary once per TP group instead of once per rank:
a GPU receives ``1/tp`` of the other stages' bytes from the PP link (the network, when stages
are on different nodes) and the rest from its TP peers (NVLink).

Ranks that do not receive every tensor yield their own stage's. Every rank of a DP replica
calls :func:`collect_stages` at the same point (it is a collective over the replica's TP and PP
groups); the stages announce each tensor's (name, shape, dtype) beforehand, so a receiver
allocates exactly what the sender sends, whatever its dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from megarl.parallel.sharding import all_gather_flat, broadcast_from_group_rank, pp_group, tp_group

Collect = Literal["stage", "leader", "all"]
Spec = tuple[str, tuple[int, ...], str]  # (HF name, shape, dtype name without "torch.")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def receives_all(collect: Collect, pp_rank: int, tp_rank: int, pp_size: int) -> bool:
    """Whether this rank yields every stage's tensors (else only its own stage's)."""
    if pp_size == 1 or collect == "all":
        return True
    return collect == "leader" and pp_rank == 0 and tp_rank == 0


def collect_stages(own: Iterable[tuple[str, torch.Tensor]], specs: Sequence[Sequence[Spec]], collect: Collect,
                   device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """This stage's ``own`` (name, full tensor) pairs, and the other stages' tensors on the ranks
    that receive them (see the module docstring), stage by stage. ``specs[s]``: what stage s
    announced, in the order it yields them. A collective over the replica's TP and PP groups."""
    from megatron.core import parallel_state as ps

    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    if collect == "stage" or len(specs) == 1:
        yield from own
    elif collect == "leader":
        yield from _to_leader(own, specs, pp_rank, tp_rank, device)
    elif collect == "all":
        yield from _to_all(own, specs, pp_rank, device)
    else:
        raise ValueError(f"collect {collect!r} is not one of stage, leader, all")


def _to_leader(own: Iterable[tuple[str, torch.Tensor]], specs: Sequence[Sequence[Spec]], pp_rank: int, tp_rank: int,
               device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    group = pp_group()
    if pp_rank != 0:  # TP rank 0 sends its stage's tensors to the leader; its TP peers only gather
        leader = dist.get_global_rank(group, 0)
        for spec, (name, full) in zip(specs[pp_rank], own, strict=True):
            check_announced(spec, name, full)
            if tp_rank == 0:
                dist.send(full.contiguous(), dst=leader, group=group)
                _hold_back()
            yield name, full
        return
    yield from own
    if tp_rank != 0:
        return
    for stage in range(1, len(specs)):
        sender = dist.get_global_rank(group, stage)
        for name, shape, dtype in specs[stage]:
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(buf, src=sender, group=group)
            yield name, buf


def _to_all(own: Iterable[tuple[str, torch.Tensor]], specs: Sequence[Sequence[Spec]], pp_rank: int,
            device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    for stage, announced in enumerate(specs):
        if stage == pp_rank:
            for spec, (name, full) in zip(announced, own, strict=True):
                check_announced(spec, name, full)
                _broadcast_sliced(full, stage, full.shape, full.dtype, device)
                _hold_back()
                yield name, full
        else:
            for name, shape, dtype in announced:
                yield name, _broadcast_sliced(None, stage, shape, getattr(torch, dtype), device)


def _broadcast_sliced(full: torch.Tensor | None, stage: int, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:  # fmt: skip
    """Stage ``stage``'s tensor on every rank of the replica: each TP rank's PP group carries one
    slice (flattened, the last padded), the receivers' TP group all-gathers the slices."""
    tp = dist.get_world_size(tp_group())
    if tp == 1:
        return broadcast_from_group_rank(full, stage, shape, dtype, device)
    numel = math.prod(shape)
    per = -(-numel // tp)  # ceil: every slice has the same length
    t = dist.get_rank(tp_group())
    if full is not None:  # the sender's slice, out of the tensor it keeps
        mine = full.contiguous().reshape(-1)[t * per : (t + 1) * per]
        if mine.numel() < per:  # the last slice, padded to the common length
            mine = torch.cat([mine, mine.new_zeros(per - mine.numel())])
        broadcast_from_group_rank(mine, stage, mine.shape, dtype, device)
        return full
    piece = broadcast_from_group_rank(None, stage, (per,), dtype, device)
    flat = torch.empty(per * tp, dtype=dtype, device=device)
    all_gather_flat(flat, piece, tp_group())
    return flat[:numel].view(tuple(shape))


def _hold_back() -> None:
    """On GPUs, wait for a send to leave before exporting more: NCCL returns at once, and a
    sender whose receivers are behind (the leader loading its engine) would otherwise run
    through its whole stage, every tensor it exported kept alive until it is received."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def check_announced(spec: Spec, name: str, full: torch.Tensor) -> None:
    """The tensor a stage sends must be what it announced (else the receivers' buffers differ)."""
    got = (name, tuple(full.shape), dtype_name(full.dtype))
    if got != spec:
        raise AssertionError(f"pipeline export: announced {spec}, about to send {got}")
