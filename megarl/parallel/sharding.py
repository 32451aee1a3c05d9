"""Shard / gather tensors across Megatron's tensor- and pipeline-parallel groups.

Pure communication helpers with no knowledge of model layouts (the bridges in megarl/models
decide which dim is split and how names map). All functions are collectives: every rank of the
group named in the docstring must call them in the same order.

Left out: expert-parallel and context-parallel groups (not supported yet).
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


def gather_along(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather equal shards along ``dim`` over ``group`` (default: the TP group); every rank
    gets the full tensor. A group of one returns ``tensor`` itself."""
    group = group if group is not None else tp_group()
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


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
