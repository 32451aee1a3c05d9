"""Bucketing of named tensors by bytes."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel.buckets import bucketize


def _named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]  # 4 bytes each


def test_buckets_respect_the_limit_and_keep_order():
    items = _named([10, 10, 5, 30, 1, 1, 12])
    buckets = list(bucketize(items, bucket_bytes=100))  # 25 floats per bucket
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1", "t2"], ["t3"], ["t4", "t5", "t6"]]
    # t3 (120 bytes) exceeds the bucket and travels alone; every other bucket is within 100 bytes
    for b in buckets:
        size = sum(t.numel() * 4 for _, t in b)
        assert size <= 100 or len(b) == 1


def test_each_tensor_appears_once():
    items = _named([3, 7, 2, 9, 4, 4, 4])
    flat = [n for b in bucketize(items, 40) for n, _ in b]
    assert flat == [n for n, _ in items]


def test_lazy_holds_one_bucket_plus_one_tensor():
    produced: list[str] = []

    def gen():
        for name, t in _named([5, 5, 5, 5, 5, 5]):
            produced.append(name)
            yield name, t

    it = bucketize(gen(), bucket_bytes=40)  # two 20-byte tensors per bucket
    assert [n for n, _ in next(it)] == ["t0", "t1"]
    assert produced == ["t0", "t1", "t2"]  # only the next bucket's first tensor was pulled


def test_empty_and_invalid():
    assert list(bucketize([], 10)) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketize(_named([1]), 0))
