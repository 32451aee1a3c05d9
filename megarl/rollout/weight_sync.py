"""Trainer -> engine weight sync: the shared Megatron side and the in-process and disk transports.

Data path (every transport): the model bridge gathers TP shards and PP stages and converts to
HF names and layouts (``export_fn``, e.g. ``PolicyWorker.export_weights`` or
``functools.partial(bridge.export_hf_weights, model)``) -> :class:`HFWeightStream` re-packs the
tensors into :class:`WeightBucket` s of ``bucket_mb`` MiB -> a transport sends each bucket.

Memory bound: the stream asks the exporter for the smallest groups it makes (``bucket_bytes=1``,
normally one tensor per group) and holds at most one bucket being filled plus the one tensor
that did not fit, so a push never holds more than ``bucket_mb`` + one tensor of exported
weights (consumers must not keep buckets after loading them).

Reuse by other transports (the SGLang ones in ``megarl/rollout_sglang/``): build an
``HFWeightStream`` with the same ``export_fn`` and ``bucket_mb``, iterate
``stream.buckets(version)`` on EVERY policy rank (the export is collective: TP gathers, PP
broadcasts), send each bucket your way (CUDA IPC handles, an NCCL broadcast, a file), and wrap
the loop with :func:`sync_metrics` so every transport reports the same keys. ``bucket.last``
marks the final bucket of a push. :class:`DiskWeightSync` covers ``update_weights_from_disk``:
an engine only needs ``load_weights_from_disk(directory, version)``.

Deliberately left out: delta compression, overlap of export and send, and engine restarts (a
restarted engine is re-``connect``-ed and re-pushed by the caller).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from megarl.rollout.engine import RolloutEngine, WeightBucket

ExportFn = Callable[[int], Iterable[list[tuple[str, torch.Tensor]]]]
"""``export_fn(bucket_bytes)`` -> groups of (HF name, full tensor), as the model bridge yields them."""

MIB = 1 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HFWeightStream:
    """Exported HF tensors re-packed into buckets of at most ``bucket_mb`` MiB (shared by all transports).

    A tensor larger than a bucket travels alone. ``peak_bytes`` (after a push) is the most
    exported bytes the stream held at once: at most ``bucket_mb`` MiB plus one tensor.
    """

    def __init__(self, export_fn: ExportFn, bucket_mb: float) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync.bucket_mb ({bucket_mb}) must be > 0")
        self.export_fn = export_fn
        self.bucket_bytes = int(bucket_mb * MIB)
        self.peak_bytes = 0

    def buckets(self, version: int) -> Iterator[WeightBucket]:
        """Yield the buckets of one push; the last has ``last=True`` (run on every policy rank)."""
        self.peak_bytes = 0
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0
        count = 0
        for name, tensor in self._tensors():
            size = _nbytes(tensor)
            self.peak_bytes = max(self.peak_bytes, pending_bytes + size)
            if pending and pending_bytes + size > self.bucket_bytes:
                full, pending, pending_bytes = pending, [], 0
                yield WeightBucket(full, version, last=False)
                del full
            pending.append((name, tensor))
            pending_bytes += size
            count += 1
            del tensor
        if count == 0:
            raise RuntimeError("the weight export yielded no tensors; is export_fn the policy's exporter?")
        yield WeightBucket(pending, version, last=True)

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Flatten the exporter's groups, taking items out of each group so it holds no extra reference."""
        for group in self.export_fn(1):
            if not isinstance(group, list):
                yield from group
                continue
            group.reverse()
            while group:
                yield group.pop()


def sync_metrics(seconds: float, nbytes: int) -> dict[str, float]:
    """The metrics every transport reports for one push."""
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/bytes": float(nbytes),
        "weight_sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
    }


def _check_versions(engines: Iterable[RolloutEngine], version: int) -> None:
    for i, engine in enumerate(engines):
        if engine.weight_version != version:
            raise RuntimeError(
                f"engine {i} reports weight_version {engine.weight_version} after push {version}; "
                "the push did not complete (see the engine's log)"
            )


class InProcessWeightSync:
    """Send buckets straight into torch engines living in this process (``engine.load_weights``).

    Every policy rank calls :meth:`push` (the export is collective); ranks without an engine
    connect an empty list and only take part in the export.
    """

    def __init__(self, stream: HFWeightStream) -> None:
        self.stream = stream
        self.engines: list[RolloutEngine] = []

    def connect(self, engines: Iterable[RolloutEngine]) -> None:
        self.engines = list(engines)

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        nbytes = 0
        for bucket in self.stream.buckets(version):
            nbytes += bucket.nbytes
            for engine in self.engines:
                engine.load_weights(bucket)
            del bucket
        _check_versions(self.engines, version)
        return sync_metrics(time.perf_counter() - start, nbytes)


@runtime_checkable
class DiskReloadableEngine(Protocol):
    """An engine that reloads HF safetensors from a directory (torch engine; SGLang's update_weights_from_disk)."""

    @property
    def weight_version(self) -> int: ...

    def load_weights_from_disk(self, directory: str | Path, version: int) -> None: ...


_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja")


class DiskWeightSync:
    """Write each push as HF safetensors (one file per bucket) to ``directory/v<version>``, then reload.

    ``writer``: whether this rank writes (the rank that receives full tensors, normally policy
    rank 0); other ranks only take part in the export. ``hf_dir``: the model directory whose
    config and tokenizer files are copied next to the weights, so an SGLang server can load the
    directory as a model. Older version directories are removed once the engines have loaded.
    """

    def __init__(self, stream: HFWeightStream, directory: str | Path, *, writer: bool = True,
                 hf_dir: str | Path | None = None) -> None:
        self.stream = stream
        self.directory = Path(directory)
        self.writer = writer
        self.hf_dir = Path(hf_dir) if hf_dir is not None else None
        self.engines: list[DiskReloadableEngine] = []

    def connect(self, engines: Iterable[DiskReloadableEngine]) -> None:
        engines = list(engines)
        for engine in engines:
            if not isinstance(engine, DiskReloadableEngine):
                raise TypeError(f"{type(engine).__name__} has no load_weights_from_disk(directory, version)")
        self.engines = engines

    def push(self, version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        start = time.perf_counter()
        target = self.directory / f"v{version}"
        tmp = self.directory / f"v{version}.tmp"
        if self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        nbytes = 0
        for i, bucket in enumerate(self.stream.buckets(version)):
            nbytes += bucket.nbytes
            if self.writer:
                tensors = {name: t.detach().contiguous().cpu() for name, t in bucket.tensors}
                save_file(tensors, str(tmp / f"model-{i:05d}.safetensors"))
            del bucket
        if self.writer:
            self._publish(tmp, target)
            for engine in self.engines:
                engine.load_weights_from_disk(target, version)
            _check_versions(self.engines, version)
            for old in self.directory.glob("v*"):
                if old != target:
                    shutil.rmtree(old, ignore_errors=True)
        return sync_metrics(time.perf_counter() - start, nbytes)

    def _publish(self, tmp: Path, target: Path) -> None:
        if self.hf_dir is not None:
            for name in _HF_SIDE_FILES:
                if (self.hf_dir / name).exists():
                    shutil.copy2(self.hf_dir / name, tmp / name)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # atomic: an engine never sees a half-written version
