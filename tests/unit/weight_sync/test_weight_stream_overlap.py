"""The weight stream's double buffering (``overlap``): the export runs one bucket ahead of the
consumer and no further, the buckets are the same as without it, a consumer that fails leaves
the export to finish (no peer left in a collective) and the check refuses the push, an error of
the export reaches the consumer, and the progress file shows both places."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from megarl.weight_sync.export_check import (
    ExportCheck,
    Observation,
    WeightExportError,
    tensor_stats,
)
from megarl.weight_sync.progress import PushProgress, read_place
from megarl.weight_sync.stream import MIB, WeightStream

SIZES = [64, 300, 64, 200, 64, 64, 500, 64, 64, 128, 64, 64]  # KiB of each fp32 tensor; the largest < a bucket (512)


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(kib * 256, generator=gen) for i, kib in enumerate(SIZES)}


class _Export:
    """An export_fn over ``weights`` (fresh copies, as a TP gather makes), noting what it made."""

    def __init__(self, weights: dict[str, torch.Tensor], fail_at: str | None = None,
                 wait_at: tuple[str, threading.Event] | None = None) -> None:  # fmt: skip
        self.weights, self.fail_at, self.wait_at = weights, fail_at, wait_at
        self.made: list[str] = []
        self.alive: dict[int, int] = {}

    def __call__(self):
        for name, t in self.weights.items():
            if name == self.fail_at:
                raise RuntimeError(f"gather of {name} failed")
            if self.wait_at is not None and name == self.wait_at[0]:
                assert self.wait_at[1].wait(30), f"the test never let the export of {name} go on"
            copy = t.clone()
            self.alive[id(copy)] = copy.numel() * copy.element_size()
            weakref.finalize(copy, self.alive.pop, id(copy), None)
            self.made.append(name)
            yield name, copy


def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_the_export_runs_one_bucket_ahead_and_no_further():
    weights = _weights()
    plain = [b.tensors for b in WeightStream(_Export(weights), bucket_mb=0.5, overlap=False).buckets(1)]
    through = [sum(len(b) for b in plain[: k + 1]) for k in range(len(plain))]  # tensors in buckets 1..k+1
    export = _Export(weights)
    stream = WeightStream(export, bucket_mb=0.5)  # overlap is the default
    cap, largest = stream.bucket_bytes, max(t.numel() * 4 for t in weights.values())
    got, live_peak = [], 0
    for k, bucket in enumerate(stream.buckets(version=1)):
        if not bucket.last:
            # While bucket k is "sent", the export goes on through bucket k+1 and the tensor
            # that does not fit in it (or to the end)...
            stop_at = min(through[k + 1] + 1, len(weights))
            assert _wait_for(lambda n=stop_at: len(export.made) >= n), ("the export did not run ahead", k)
            time.sleep(0.05)
            # ...and no further
            assert len(export.made) == stop_at, (k, len(export.made))
        live_peak = max(live_peak, sum(export.alive.values()))
        got += [(n, t.clone()) for n, t in bucket.tensors]
        del bucket
    assert len(plain) >= 4 and stream.pushed_buckets == len(plain)
    assert [n for n, _ in got] == [n for b in plain for n, _ in b] == list(weights)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, [x for b in plain for x in b]))
    assert cap + largest < stream.peak_bytes <= 2 * cap + largest  # more than one bucket's worth, at most two
    assert 0 < live_peak <= 2 * cap + largest  # what really stayed alive, not just what was counted


class _Check(ExportCheck):
    """An ExportCheck whose expected side is given (no Megatron model in a unit test)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(None, None)
        self.expected = {(n,): tuple(float(x) for x in tensor_stats(t)) for n, t in weights.items()}

    def observe(self, *, collect: str = "all") -> Observation:
        self.open += 1
        return Observation(self.expected, self)


def test_a_consumer_that_fails_leaves_the_export_to_finish_and_the_check_refuses(tmp_path):
    weights = _weights()
    export, check = _Export(weights), _Check(weights)
    progress = PushProgress(rank_log=str(tmp_path / "rank0.log"))
    stream = WeightStream(export, bucket_mb=0.5, observe=check.observe, progress=progress)

    def fail_at_the_first_bucket() -> None:
        for _ in stream.buckets(version=1):
            raise ConnectionResetError("the engine died")

    with pytest.raises(ConnectionResetError):
        fail_at_the_first_bucket()
    assert export.made == list(weights)  # drained: every collective of the export ran
    assert read_place(tmp_path / "rank0.log").phase.startswith("consumer stopped; exporting")  # what the deadline report shows
    assert not any(t.name.startswith("weight-export") for t in threading.enumerate())
    with pytest.raises(WeightExportError, match="not read to its end"):
        check.verdict(1)
    list(stream.buckets(version=2))  # the next push is whole again
    check.verdict(2)


def test_an_error_of_the_export_reaches_the_consumer():
    weights = _weights()
    stream = WeightStream(_Export(weights, fail_at="w7"), bucket_mb=0.5)
    received = []
    with pytest.raises(RuntimeError, match="gather of w7 failed"):
        for bucket in stream.buckets(version=1):
            received += [n for n, _ in bucket.tensors]
    assert received and "w7" not in received
    assert not any(t.name.startswith("weight-export") for t in threading.enumerate())


def test_the_progress_file_shows_the_bucket_sent_and_the_one_exported(tmp_path):
    progress = PushProgress(rank_log=str(tmp_path / "rank0.log"))
    # Bucket 3 is w6 alone (500 KiB; w7 does not fit with it): the export waits before w7 until
    # the test has read the file, so the producer is surely inside bucket 3's export.
    go_on = threading.Event()
    stream = WeightStream(_Export(_weights(), wait_at=("w7", go_on)), bucket_mb=0.5, progress=progress)
    seen: set[str] = set()

    def shows_both() -> bool:
        seen.add(read_place(tmp_path / "rank0.log").phase)
        return "sending bucket 2, exporting bucket 3" in seen

    try:  # any failure lets the export go on: its thread is joined when the stream closes
        for bucket in stream.buckets(version=3):
            if bucket.index == 2:
                assert [n for n, _ in bucket.tensors] == ["w3", "w4", "w5"]
                assert _wait_for(shows_both), seen
                go_on.set()
    finally:
        go_on.set()
    assert read_place(tmp_path / "rank0.log").phase.startswith("bucket stream finished")


def test_bucket_sizes_in_mib():
    assert WeightStream(_Export({}), bucket_mb=0.5).bucket_bytes == MIB // 2
