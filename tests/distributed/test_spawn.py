"""The gloo process launcher used by the distributed tests."""

from __future__ import annotations

import pytest
from spawn import run_distributed


def _sum_ranks(rank: int, world: int, offset: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, int(t)


def _rank1_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 would wait forever: the launcher must stop it
    return rank


def test_results_come_back_in_rank_order():
    assert run_distributed(_sum_ranks, 2, 10) == [(0, 21), (1, 21)]


def test_a_failing_rank_is_reported_and_the_others_stopped():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 ---.*ValueError: boom on rank 1"):
        run_distributed(_rank1_fails, 2, timeout_s=60)
