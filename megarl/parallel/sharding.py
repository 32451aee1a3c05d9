"""Shard / gather tensors across Megatron's tensor- and pipeline-parallel groups.

Pure communication helpers with no knowledge of model layouts (the bridges in megarl/models
decide which dim is split and how names map). All functions are collectives: every rank of the
group named in the docstring must call them in the same order.

The expert-parallel group (MoE models: the ranks that split the experts) and the
expert-tensor-parallel group (the ranks that split each expert) gather with the same helpers
(``group=ep_group()`` / ``etp_group()``). Left out: context-parallel groups (not supported yet).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def pp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def ep_group() -> dist.ProcessGroup:
    """The expert-parallel group: the ranks that hold different experts of the same layers (it
    may span data-parallel replicas; size 1 for a dense model)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def etp_group() -> dist.ProcessGroup:
    """The expert-tensor-parallel group: the ranks that split each of the same experts (size 1
    while every expert is whole on its rank)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_group()


def all_gather_flat(out: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``piece`` into ``out`` (``[world * n, ...]``, rank by rank): torch's
    all_gather_single where it exists (2.13 deprecates all_gather_into_tensor), else the older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, piece, group=group)


def gather_shards(shards: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """All-gather several tensors' equal shards over ``group`` (default: the TP group) with one
    collective per dtype, not one per tensor: ``[(shard, dim)]`` -> the full tensors (the ranks'
    shards, at least 1-d, joined along ``dim``), in order. Every rank passes the same shapes and
    dtypes."""
    group = group if group is not None else tp_group()
    world = dist.get_world_size(group)
    if world == 1:
        return [shard for shard, _ in shards]
    full: list[torch.Tensor | None] = [None] * len(shards)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (shard, _) in enumerate(shards):
        by_dtype.setdefault(shard.dtype, []).append(i)
    for members in by_dtype.values():
        shard, dim = shards[members[0]]
        if len(members) == 1 and dim == 0:  # the ranks' slabs in order are the tensor: no copy out
            shard = shard.contiguous()
            full[members[0]] = out = shard.new_empty(world * shard.shape[0], *shard.shape[1:])
            all_gather_flat(out, shard, group)
            continue
        # [n]: this rank's shards back to back (a lone shard needs no copy)
        flat = shard.reshape(-1) if len(members) == 1 else torch.cat([shards[i][0].reshape(-1) for i in members])
        gathered = flat.new_empty(world * flat.numel())  # [world * n]: every rank's, rank by rank
        all_gather_flat(gathered, flat, group)
        gathered = gathered.view(world, -1)  # [world, n]
        del flat
        start = 0
        for i in members:
            shard, dim = shards[i]
            slabs = [gathered[r, start : start + shard.numel()].view(shard.shape) for r in range(world)]
            full[i] = torch.cat(slabs, dim=dim)
            start += shard.numel()
    return full  # type: ignore[return-value]  # every index was filled by its dtype's gather


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank of ``group`` (default: the PP group) gets the list of all ranks' ``obj``,
    indexed by group rank."""
    group = group if group is not None else pp_group()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_group_rank(
    tensor: torch.Tensor | None,
    src_group_rank: int,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Broadcast ``tensor`` from group rank ``src_group_rank`` of ``group`` (default: PP group);
    the other ranks pass None and receive a new tensor of ``shape``/``dtype``."""
    group = group if group is not None else pp_group()
    if dist.get_world_size(group) == 1:
        assert tensor is not None
        return tensor
    if dist.get_rank(group) == src_group_rank:
        assert tensor is not None
        buf = tensor.contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=dist.get_global_rank(group, src_group_rank), group=group)
    return buf
