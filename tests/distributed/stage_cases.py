"""What the stage-collection tests send and expect, shared by the PP=3 test
(test_stage_collection.py) and the TP=2 x PP=2 bridge launch (test_bridge.py)."""

from __future__ import annotations

import torch


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
