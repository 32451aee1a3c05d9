"""The collection of the pipeline stages' exported tensors (megarl/parallel/stage_collection.py)
on its own, in 3 gloo processes (TP=1 x PP=3): with every collect, each rank gets exactly the
tensors it should, bit for bit, in stage order: odd sizes, two dtypes and a 0-d tensor. The
TP=2 x PP=2 layout (slices over the PP group, all-gathered in TP) runs the same check inside
tests/distributed/test_bridge.py's 4-process launch.
"""

from __future__ import annotations

import torch
from spawn import run_distributed


def stage_tensors(stage: int) -> list[tuple[str, torch.Tensor]]:
    """What stage ``stage`` exports: sizes that do not split evenly, fp32 and bf16, a 0-d tensor."""
    gen = torch.Generator().manual_seed(stage)
    return [(f"s{stage}.a", torch.randn(3, generator=gen)),
            (f"s{stage}.b", torch.randn(5, 7, generator=gen).to(torch.bfloat16)),
            (f"s{stage}.c", torch.randn((), generator=gen)),
            (f"s{stage}.d", torch.randn(1, generator=gen))]  # fmt: skip


def collected(pp_rank: int, pp_size: int) -> dict[str, dict]:
    """On this rank, for each collect: the names it yields in order, and those unequal to the
    sender's tensor (a collective over the replica's TP and PP groups)."""
    from megarl.parallel.stage_collection import collect_stages, dtype_name

    specs = [[(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in stage_tensors(s)] for s in range(pp_size)]
    want = {n: t for s in range(pp_size) for n, t in stage_tensors(s)}
    out = {}
    for collect in ("all", "leader", "stage"):
        got = list(collect_stages(iter(stage_tensors(pp_rank)), specs, collect, torch.device("cpu")))
        out[collect] = {"names": [n for n, _ in got],
                        "unequal": [n for n, t in got if t.dtype != want[n].dtype or not torch.equal(t, want[n])]}  # fmt: skip
    return out


def expected_names(collect: str, pp_rank: int, tp_rank: int, pp_size: int) -> list[str]:
    every = [n for s in range(pp_size) for n, _ in stage_tensors(s)]
    own = [n for n, _ in stage_tensors(pp_rank)]
    if collect == "all" or (collect == "leader" and (pp_rank, tp_rank) == (0, 0)):
        return every
    return own


def _pp3_worker(rank: int, world: int) -> dict:
    from megarl.parallel.groups import destroy_parallel, init_parallel

    info = init_parallel(tp=1, pp=3, seed=0)
    out = {"where": (info.pp_rank, info.tp_rank), "collected": collected(info.pp_rank, info.pp_size)}
    destroy_parallel()
    return out


def test_three_stages_reach_the_ranks_each_collect_names():
    results = run_distributed(_pp3_worker, 3)
    assert sorted(r["where"] for r in results) == [(0, 0), (1, 0), (2, 0)]
    for r in results:
        for collect, got in r["collected"].items():
            assert got["names"] == expected_names(collect, *r["where"], 3), (r["where"], collect)
            assert got["unequal"] == [], (r["where"], collect)
