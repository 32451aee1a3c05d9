"""The one producer of weight buckets: the policy's HF export, packed into buckets once.

Data path of every push: the model bridge gathers TP shards, brings the pipeline stages'
tensors to the ranks that load them (megarl/parallel/stage_collection.py) and converts
Megatron names and layouts to HF ones, yielding ``(hf_name, full tensor)`` one at a time
(``export_fn``); :class:`WeightStream` packs them into
:class:`~megarl.engines.base.WeightBucket` s of ``bucket_mb`` MiB; a transport
(one file per transport in megarl/weight_sync/) sends each bucket its way.

With ``overlap`` (the default), a thread of the stream exports bucket k+1 while the transport
sends bucket k (double buffering): the export's collectives (TP gathers, stage collection) then
run beside the transport's own (engine broadcasts, payload gathers) on other groups. Without
it, export and send alternate.

Every policy rank iterates the stream (the export is collective); ranks that send nothing
drop the buckets. With ``observe``, each tensor's fingerprint is taken as it passes, for the
check of the export against the policy's parameters (megarl/weight_sync/export_check.py).

Memory bound (consumers must not keep buckets after sending them): one bucket being filled
plus the tensor that did not fit; with ``overlap``, also the bucket being sent: at most
``2 x bucket_mb`` plus the largest tensor (a tensor larger than a bucket is a bucket of its
own, and then counts for one). ``peak_bytes`` reports the most the stream held.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megarl.engines.base import WeightBucket
from megarl.weight_sync.progress import PushProgress


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
                 progress: PushProgress | None = None, overlap: bool = True) -> None:  # fmt: skip
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync.bucket_mb ({bucket_mb}) must be > 0")
        self.export_fn = export_fn
        # observe() -> an Observation (megarl/weight_sync/export_check.py) of each push's tensors, or None
        self.observe = observe
        self.bucket_bytes = int(bucket_mb * MIB)
        self.progress = progress or PushProgress(rank_log="")  # "": notes nothing
        self.overlap = overlap
        self.peak_bytes = 0
        self.pushed_bytes = self.pushed_buckets = 0  # of the last push, for its metrics
        self._held = 0  # exported bytes alive now: the bucket being sent (overlap) + the one being filled
        self._where: dict[str, str | None] = {}  # "sending" / "exporting" -> the bucket, for the progress file
        self._lock = threading.Lock()
        self._seen: Any = None  # the current push's Observation, until the consumer gets the last bucket

    def buckets(self, version: int) -> Iterator[WeightBucket]:
        """The buckets of one push; the last has ``last=True`` (run on every policy rank)."""
        self.peak_bytes = self.pushed_bytes = self.pushed_buckets = self._held = 0
        self._where = {"sending": None, "exporting": None}  # this order in the progress file
        if self.overlap:
            yield from _Prefetched(self, version)
        else:
            for bucket in self._fill(version, room=None):
                self._handing_over(bucket)
                yield bucket
                self._sent(bucket)
                del bucket
        self._note(version, sending=None, exporting=None, then="bucket stream finished (engine requests, version check)")

    def _fill(self, version: int, room: threading.Semaphore | None) -> Iterator[WeightBucket]:
        """Export and pack. ``room`` (overlap): taken after each full bucket is handed over, so
        the export goes on only once the bucket before it has been sent."""
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        self._seen = seen = self.observe() if self.observe is not None else None
        self._note(version, exporting="1 (TP gather, PP collect, HF conversion)")
        for name, tensor in self.export_fn():
            if seen is not None:
                seen.add(name, tensor)
            size = tensor_bytes(tensor)
            self._hold(size)
            if pending and pending_bytes + size > self.bucket_bytes:
                full, pending, pending_bytes = pending, [], 0
                self._note(version, exporting=None)
                yield self._bucket(full, version, last=False)
                del full  # the consumer has it: hold one bucket being filled at a time
                if room is not None:
                    room.acquire()  # wait until the bucket before the one just handed over is sent
                self._note(version, exporting=str(self.pushed_buckets + 1))
            pending.append((name, tensor))
            pending_bytes += size
            del tensor
        if not pending:
            raise RuntimeError("the weight export yielded no tensors; is export_fn the policy's exporter?")
        self._note(version, exporting=None)
        yield self._bucket(pending, version, last=True)

    def _handing_over(self, bucket: WeightBucket) -> None:
        """The consumer gets ``bucket``. The export check judges before the last one goes (a
        consumer may stop right after it); an export whose last bucket no consumer got stays
        unfinished (drained buckets were exported, not sent), and the check refuses it."""
        if bucket.last and self._seen is not None:
            self._seen.finish()
            self._seen = None
        self._note(bucket.version, sending=_bucket_label(bucket))

    def _hold(self, nbytes: int) -> None:
        with self._lock:
            self._held += nbytes
            self.peak_bytes = max(self.peak_bytes, self._held)

    def _sent(self, bucket: WeightBucket) -> None:
        """The consumer is done with ``bucket`` (sent, or dropped)."""
        with self._lock:
            self._held -= bucket.nbytes
            self._where["sending"] = None

    def _note(self, version: int, then: str | None = None, **where: str | None) -> None:
        """Mark this rank's place: what is being sent and exported (both, with overlap); once
        the consumer stopped early, what the export drops."""
        with self._lock:
            self._where.update(where)
            phase = ", ".join(f"{k} bucket {v}" for k, v in self._where.items() if v is not None and k != "draining")
            if self._where.get("draining"):
                phase = f"consumer stopped; {phase or 'exporting'} {self._where['draining']}"
            # neither: a bucket just exported, on its way to the sender (overlap: another thread)
            self.progress.mark(version, then or phase or "between buckets (handing the next one to the sender)")

    def _bucket(self, tensors: list[tuple[str, torch.Tensor]], version: int, last: bool) -> WeightBucket:
        """The next bucket of the push, counted for its metrics."""
        self.pushed_buckets += 1
        bucket = WeightBucket(tensors, version, last=last, index=self.pushed_buckets)
        self.pushed_bytes += bucket.nbytes
        return bucket

    def metrics(self, seconds: float) -> dict[str, float]:
        """The last push's metrics (every transport reports these keys)."""
        return sync_metrics(seconds, self.pushed_bytes, self.pushed_buckets)


def _bucket_label(bucket: WeightBucket) -> str:
    return f"{bucket.index} (the last)" if bucket.last else str(bucket.index)


class _Prefetched:
    """One push's buckets, exported by a thread of their own one bucket ahead of the consumer.

    The thread stops at the end of the export, never earlier: a consumer that fails (an engine
    that died) or stops reading leaves it to finish the export and drop the rest, so the
    export's collectives complete on every rank and no TP or PP peer is left waiting in one.
    An error of the export itself reaches the consumer at its next bucket.
    """

    _END = object()

    def __init__(self, stream: WeightStream, version: int) -> None:
        self.stream, self.version = stream, version
        self.ready: queue.Queue[Any] = queue.Queue()
        self.room = threading.Semaphore(1)  # the first handover needs no wait: nothing is being sent yet
        self.consumer_gone = threading.Event()
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def __iter__(self) -> Iterator[WeightBucket]:
        thread = threading.Thread(target=self._produce, name=f"weight-export-v{self.version}", daemon=True)
        thread.start()
        ended = False
        try:
            while (item := self.ready.get()) is not self._END:
                if isinstance(item, BaseException):
                    ended = True  # the export itself failed: nothing left to finish
                    raise item
                self.stream._handing_over(item)
                yield item
                self.stream._sent(item)
                del item
                self.room.release()
            ended = True
        finally:
            if not ended:  # the consumer stopped early: the rest of the export is dropped
                self.stream._note(self.version, sending=None, draining="(finishing the export for the TP/PP peers)")
            self.consumer_gone.set()
            self.room.release()  # a producer waiting for room goes on (and drains)
            thread.join()

    def _produce(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        try:
            for bucket in self.stream._fill(self.version, self.room):
                if self.consumer_gone.is_set():
                    self.stream._sent(bucket)  # dropped: nobody sends it
                    self.room.release()
                else:
                    self.ready.put(bucket)
                del bucket
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.ready.put(exc)
        else:
            self.ready.put(self._END)


def sync_metrics(seconds: float, nbytes: int, buckets: int) -> dict[str, float]:
    """The metrics every transport reports for one push."""
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/bytes": float(nbytes),
        "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
        "weight_sync/buckets": float(buckets),
    }
