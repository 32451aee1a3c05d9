"""The one producer of weight buckets: the policy's HF export, packed into buckets once.

Data path of every push: the model bridge gathers TP shards (and, unless a transport sends
stage by stage, collects the PP stages) and converts Megatron names and layouts to HF ones,
yielding ``(hf_name, full tensor)`` one at a time (``export_fn``); :class:`WeightStream` packs
them into :class:`~megarl.rollout.engine.WeightBucket` s of ``bucket_mb`` MiB; a transport
(megarl/rollout/transports.py, megarl/rollout_sglang/transports.py) sends each bucket its way.

Every policy rank iterates the stream (the export is collective); ranks that send nothing
drop the buckets. With ``observe``, each tensor's fingerprint is taken as it passes, for the
check of the export against the policy's parameters (megarl/models/fingerprint.py).
Memory bound: at most one bucket being filled plus the one tensor that did not fit is held at
once (consumers must not keep buckets after sending them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megarl.rollout.engine import WeightBucket
from megarl.rollout.push_progress import PushProgress


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

ExportFn = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""``export_fn()`` -> (HF name, full tensor) pairs, one at a time (a collective over the policy)."""

MIB = 1 << 20


class WeightStream:
    """The policy's export in buckets of at most ``bucket_mb`` MiB (a larger tensor travels alone).

    ``peak_bytes`` (after a push) is the most exported bytes the stream held at once.
    """

    def __init__(self, export_fn: ExportFn, bucket_mb: float, observe: Callable[[], Any] | None = None,
                 progress: PushProgress | None = None) -> None:  # fmt: skip
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync.bucket_mb ({bucket_mb}) must be > 0")
        self.export_fn = export_fn
        # observe() -> an Observation (megarl/models/fingerprint.py) of each push's tensors, or None
        self.observe = observe
        self.bucket_bytes = int(bucket_mb * MIB)
        self.progress = progress or PushProgress(rank_log="")  # "": notes nothing
        self.peak_bytes = 0
        self.pushed_bytes = self.pushed_buckets = 0  # of the last push, for its metrics

    def buckets(self, version: int) -> Iterator[WeightBucket]:
        """The buckets of one push; the last has ``last=True`` (run on every policy rank)."""
        self.peak_bytes = self.pushed_bytes = self.pushed_buckets = 0
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        seen = self.observe() if self.observe is not None else None
        self.progress.mark(version, "exporting bucket 1 (TP gather, PP collect, HF conversion)")
        for name, tensor in self.export_fn():
            if seen is not None:
                seen.add(name, tensor)
            size = tensor_bytes(tensor)
            self.peak_bytes = max(self.peak_bytes, pending_bytes + size)
            if pending and pending_bytes + size > self.bucket_bytes:
                full, pending, pending_bytes = pending, [], 0
                self.progress.mark(version, f"sending bucket {self.pushed_buckets + 1}")
                yield self._counted(WeightBucket(full, version, last=False))
                del full  # the consumer is done with it: hold one bucket at a time
                self.progress.mark(version, f"exporting bucket {self.pushed_buckets + 1}")
            pending.append((name, tensor))
            pending_bytes += size
            del tensor
        if not pending:
            raise RuntimeError("the weight export yielded no tensors; is export_fn the policy's exporter?")
        if seen is not None:
            seen.finish()  # before the last bucket goes: a consumer may stop right after it
        self.progress.mark(version, f"sending bucket {self.pushed_buckets + 1} (the last)")
        yield self._counted(WeightBucket(pending, version, last=True))
        self.progress.mark(version, "bucket stream finished (engine requests, version check)")

    def _counted(self, bucket: WeightBucket) -> WeightBucket:
        self.pushed_bytes += bucket.nbytes
        self.pushed_buckets += 1
        return bucket

    def metrics(self, seconds: float) -> dict[str, float]:
        """The last push's metrics (every transport reports these keys)."""
        return sync_metrics(seconds, self.pushed_bytes, self.pushed_buckets)


def sync_metrics(seconds: float, nbytes: int, buckets: int) -> dict[str, float]:
    """The metrics every transport reports for one push."""
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/bytes": float(nbytes),
        "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
        "weight_sync/buckets": float(buckets),
    }
