"""Process groups that carry weights from trainer ranks to SGLang engines (disaggregated).

One group per pipeline stage of the policy. In the group of stage ``s`` the trainer rank
that sends stage ``s`` (its DP=0, TP=0 rank) is rank 0 and every GPU of every engine joins:
engine ``i``'s TP rank ``r`` is ``1 + sum(tp of engines before i) + r``. SGLang computes that
rank itself from the ``rank_offset`` we send (``rank_offset + tp_rank``), so the plan here
and SGLang must agree on the offsets, which :func:`plan_stage_group` fixes.

The trainer side of a group is built the way SGLang builds its side (a standalone group on a
``TCPStore`` hosted by rank 0, wrapped in ``PrefixStore(group_name)``, then torch's group
constructor), because the two sides find each other through the store keys that layout
produces. That needs torch's internal ``_new_process_group_helper``: there is no public API
that creates a group outside the default world. It is used through one function,
:func:`open_update_group`, and checked by a CPU (gloo) test.

Deliberately left out: several engines per node sharing a group with other trainers' groups,
and groups spanning expert-parallel ranks (MoE is out of scope).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_PREFIX = "megarl_wsync"


@dataclass(frozen=True)
class StageGroup:
    """The plan of one stage's group (identical on the trainer and in the engine requests)."""

    name: str
    pp_rank: int
    master_address: str
    master_port: int
    world_size: int
    engine_rank_offsets: tuple[int, ...]  # one per engine, in engine order


def engine_rank_offsets(engine_tps: Sequence[int]) -> list[int]:
    """Rank of each engine's TP rank 0: trainer sender = 0, then engines' GPUs in order."""
    offsets, next_rank = [], 1
    for tp in engine_tps:
        if tp < 1:
            raise ValueError(f"engine tp ({tp}) must be >= 1")
        offsets.append(next_rank)
        next_rank += tp
    return offsets


def stage_group_name(pp_rank: int, prefix: str = GROUP_PREFIX) -> str:
    return f"{prefix}_pp{pp_rank}"


def plan_stage_group(
    engine_tps: Sequence[int],
    pp_rank: int,
    master_address: str,
    master_port: int,
    prefix: str = GROUP_PREFIX,
) -> StageGroup:
    """The group of stage ``pp_rank``, hosted at ``master_address:master_port`` by its sender."""
    if not engine_tps:
        raise ValueError(
            "no engines to connect; start the SGLang engines before connecting weight sync"
        )
    offsets = tuple(engine_rank_offsets(engine_tps))
    world = 1 + sum(engine_tps)
    return StageGroup(
        stage_group_name(pp_rank, prefix), pp_rank, master_address, master_port, world, offsets
    )


def open_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout: timedelta = timedelta(minutes=10),
) -> dist.ProcessGroup:
    """Join a standalone group (outside the default world) the way an SGLang engine does.

    Rank 0 hosts the ``TCPStore`` and blocks until all ``world_size`` members connected, so
    the engines' ``/init_weights_update_group`` requests must already be on their way.
    """
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(group_name, store)
    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    # torch >= 2.6 names the option argument backend_options; older releases pg_options.
    option_kw = (
        "backend_options"
        if "backend_options" in inspect.signature(helper).parameters
        else "pg_options"
    )
    made = helper(
        world_size, rank, [], backend, prefixed,
        # newer torch types group_name as c10d.GroupName, a NewType of str (a str at run time) older ones lack
        group_name=group_name, timeout=timeout, **{option_kw: None},  # type: ignore[arg-type]
    )  # fmt: skip
    group = made[0] if isinstance(made, tuple) else made
    # Group ranks are global ranks here, so collectives that take ``src`` map 0 -> 0.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Send ``tensors`` from rank 0 in list order (the order of the request's ``names``)."""
    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def flattened_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """A bucket as SGLang's ``load_format: "flattened_bucket"`` receives it over a group: the
    tensors' bytes one after another, without padding, in the order of the returned list (the
    request's ``names``), as one uint8 tensor to broadcast once. SGLang views each tensor at its
    byte offset and refuses (0.5.23: before it receives anything) an offset that is not a multiple
    of the dtype's size, so the widest dtypes go first: sizes are powers of two, every offset is
    then aligned (a 3-element bf16 tensor before an fp32 one would put it at byte 6)."""
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in ordered])  # [sum of nbytes] uint8
    return ordered, flat


def close_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
