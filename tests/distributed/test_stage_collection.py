"""The collection of the pipeline stages' exported tensors (megarl/parallel/stage_collection.py)
on its own, in 3 gloo processes (TP=1 x PP=3): with every collect, each rank gets exactly the
tensors it should, bit for bit, in stage order: odd sizes, two dtypes and a 0-d tensor. The
TP=2 x PP=2 layout (slices over the PP group, all-gathered in TP) runs the same check inside
tests/distributed/test_bridge.py's 4-process launch.
"""

from __future__ import annotations

from spawn import run_distributed
from stage_cases import collected, expected_names


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
