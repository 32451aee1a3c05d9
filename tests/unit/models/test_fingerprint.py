"""Weight fingerprints (megarl/weight_sync/export_check.py): hand-computed sums, what a mismatch names,
and the weight stream taking them as the tensors pass. The sums from real Megatron shards
against HF files: tests/distributed/test_bridge.py; a push refused: test_logprob_threshold.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megarl.weight_sync.export_check import (
    ExportCheck,
    Observation,
    WeightExportError,
    tensor_stats,
)
from megarl.weight_sync.stream import WeightStream


def test_stats_are_fp64_sum_and_magnitude_sum():
    t = torch.tensor([[1.5, -2.0], [0.25, -0.75]], dtype=torch.bfloat16)
    assert tensor_stats(t).tolist() == [-1.0, 4.5]
    big = torch.full((3, 1 << 23), 0.1, dtype=torch.float32)  # 1.5 chunks: summed chunk by chunk
    assert abs(float(tensor_stats(big)[0]) - 0.1 * 3 * (1 << 23)) < 1e-6 * 3 * (1 << 23)


def _expected(tensors: dict[str, torch.Tensor], groups: list[tuple[str, ...]]) -> dict:
    out = {}
    for names in groups:
        s = sum(tensor_stats(tensors[n]) for n in names)
        out[names] = (float(s[0]), float(s[1]))
    return out


def _observed(expected: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    seen = Observation(expected, ExportCheck(None, None))
    for name, t in tensors.items():
        seen.add(name, t)
    return seen.mismatches()


def test_a_group_is_judged_as_a_whole_and_every_kind_of_difference_is_named():
    torch.manual_seed(0)
    tensors = {n: torch.randn(64, 32).to(torch.bfloat16) for n in ("q", "k", "v", "down", "norm")}
    groups = [("q", "k", "v"), ("down",), ("norm",)]
    expected = _expected(tensors, groups)
    assert _observed(expected, tensors) == []
    # q and k exchanged inside their group: the same numbers, invisible to sums (the probe's job)
    assert _observed(expected, {**tensors, "q": tensors["k"], "k": tensors["q"]}) == []

    scaled = _observed(expected, {**tensors, "down": tensors["down"] * 1.01})
    assert len(scaled) == 1 and scaled[0].startswith("down: sum ")
    flipped = _observed(expected, {**tensors, "norm": -tensors["norm"]})  # same magnitudes, other sum
    assert [m.split(":")[0] for m in flipped] == ["norm"]
    missing = _observed(expected, {n: t for n, t in tensors.items() if n != "v"})
    assert missing == ["v: never exported"]
    extra = _observed(expected, {**tensors, "lm_head": tensors["down"]})
    assert extra == ["lm_head: exported but no parameter holds it"]
    cross = _observed(expected, {**tensors, "down": tensors["q"], "q": tensors["down"]})
    assert sorted(m.split(":")[0] for m in cross) == ["down", "q+k+v"]


def test_summation_order_does_not_matter():
    """The expected side adds TP shards, the observed side whole tensors: the same bf16 values
    in another order agree far inside the bound."""
    torch.manual_seed(1)
    full = torch.randn(1024, 256).to(torch.bfloat16)
    shards = full.chunk(8, dim=1)
    total = sum(tensor_stats(s) for s in shards)
    assert _observed({("w",): (float(total[0]), float(total[1]))}, {"w": full}) == []


class _Check(ExportCheck):
    """An ExportCheck whose expected side is given (no Megatron model in a unit test)."""

    def __init__(self, expected: dict) -> None:
        super().__init__(None, None)
        self.expected = expected

    def observe(self, *, collect: str) -> Observation:
        self.open += 1
        return Observation(self.expected, self)


def test_the_stream_observes_every_tensor_and_the_verdict_judges_each_push():
    torch.manual_seed(2)
    weights = {f"w{i}": torch.randn(256, 256) for i in range(5)}  # 256 KiB each
    check = _Check(_expected(weights, [(n,) for n in weights]))

    def export(corrupt: bool):
        return lambda: ((n, t * 1.01 if corrupt and n == "w4" else t) for n, t in weights.items())

    stream = WeightStream(export(True), bucket_mb=0.5, observe=partial(check.observe, collect="all"))
    for bucket in stream.buckets(version=1):
        if bucket.last:
            assert [m.split(":")[0] for m in check.problems] == ["w4"]  # judged before a consumer can stop
            break
    assert stream.pushed_buckets >= 2
    with pytest.raises(WeightExportError, match="weight push 1: 1 exported tensor"):
        check.verdict(1)

    stream.export_fn = export(False)
    list(stream.buckets(version=2))
    check.verdict(2)  # a clean push after a refused one: nothing carried over

    next(iter(stream.buckets(version=3)))  # a consumer that stopped after the first bucket
    with pytest.raises(WeightExportError, match="not read to its end"):
        check.verdict(3)
    check.verdict(4, failure=RuntimeError("the engine died"))  # this rank's own failure: its caller raises
