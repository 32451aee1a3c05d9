"""WeightSync transports to SGLang engines: from tensor (CUDA IPC), from distributed (NCCL),
from disk. Each implements megarl.rollout.engine.WeightSync: ``connect(engines)`` then
``push(version) -> metrics``.

Data path (shared, not here): the policy gathers TP shards, collects PP stages, converts to
HF names and layouts and packs buckets of ``bucket_mb`` (megarl/rollout/weight_sync.py). A
transport takes that as a *bucket source*: a callable returning a fresh iterable of buckets,
each a ``list[(hf_name, tensor)]`` (or a WeightBucket). Only the send differs per class.

The order of calls to every engine in one push (the update state machine):

    resume_memory(["weights"])        if the engine released its memory (colocated)
    pause_generation                  no request runs while weights change
    flush_cache                       retried while SGLang answers 400
    bucket 1 .. bucket k              flush_cache=False each; the last one carries
                                      weight_version
    continue_generation
    resume_memory(["kv_cache", "cuda_graph"])   if they were released
    check weight_version              /model_info must report the pushed version

After an engine died: :meth:`_SGLangSync.recover` relaunches it, rebuilds the groups
(``connect``), re-pushes the weights and checks the version on every engine.

Deliberately left out: pushing to a subset of engines, overlapping stages of the
distributed path (stages send one after another: an engine serves one update request at a
time, so two stages' broadcasts in flight on two engines in opposite orders would deadlock).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from megarl.rollout.engine import WeightBucket
from megarl.rollout_sglang.engine import CUDA_GRAPH, KV_CACHE, WEIGHTS, SGLangEngine
from megarl.rollout_sglang.server import pick_free_port
from megarl.rollout_sglang.tensor_payload import build_tensor_requests, serialize_for_http
from megarl.rollout_sglang.update_group import (
    GROUP_PREFIX,
    StageGroup,
    broadcast_tensors,
    close_update_group,
    open_update_group,
    plan_stage_group,
)

Named = list[tuple[str, torch.Tensor]]
Bucket = Sequence[tuple[str, torch.Tensor]] | WeightBucket
BucketSource = Callable[[], Iterable[Bucket]]


def _named(bucket: Bucket) -> Named:
    return list(bucket.tensors) if isinstance(bucket, WeightBucket) else list(bucket)


def with_last(buckets: Iterable[Bucket]) -> Iterator[tuple[Named, bool]]:
    """Yield (bucket, is_last) with one bucket of look-ahead; refuse an empty push."""
    it = iter(buckets)
    try:
        prev = _named(next(it))
    except StopIteration:
        raise ValueError("the bucket source yielded no buckets; nothing to push") from None
    for cur in it:
        yield prev, False
        prev = _named(cur)
    yield prev, True


def begin_update(engines: Sequence[SGLangEngine]) -> None:
    """Steps before the first bucket, on every engine (see the module docstring)."""
    for engine in engines:
        engine.resume_memory([WEIGHTS])
        engine.pause_generation()
        engine.flush_cache()


def end_update(engines: Sequence[SGLangEngine], version: int) -> None:
    """Steps after the last bucket, on every engine; raises WeightVersionMismatch."""
    for engine in engines:
        engine.continue_generation()
        engine.resume_memory([KV_CACHE, CUDA_GRAPH])
        engine.check_weight_version(version)


def _metrics(seconds: float, nbytes: int, buckets: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "bytes": float(nbytes),
        "gb_per_s": nbytes / 1e9 / seconds if seconds > 0 else 0.0,
        "buckets": float(buckets),
    }


def _nbytes(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


class _SGLangSync:
    """What the three transports share: the engine list and recovery after a restart."""

    def __init__(self) -> None:
        self.engines: list[SGLangEngine] = []

    def connect(self, engines: Iterable[SGLangEngine]) -> None:
        engines = list(engines)
        for engine in engines:
            if not isinstance(engine, SGLangEngine):
                raise TypeError(
                    f"{type(self).__name__} drives SGLang engines; got {type(engine).__name__}"
                )
        self.engines = engines

    def push(self, version: int) -> dict[str, float]:
        raise NotImplementedError

    def recover(self, version: int, timeout: float = 600.0) -> list[SGLangEngine]:
        """Relaunch dead engines, rebuild groups, re-push ``version`` to all and check it.

        Returns the engines that were restarted (empty: nothing to do, nothing pushed).
        """
        dead = [e for e in self.engines if not e.health().alive]
        for engine in dead:
            engine.restart(timeout)
        if dead:
            self.connect(self.engines)
            self.push(version)
        return dead


class SGLangTensorSync(_SGLangSync):
    """Colocated: tensors stay on the trainer's GPU and reach SGLang as CUDA IPC handles.

    ``bucket_class`` and ``serialize`` default to SGLang's FlattenedTensorBucket (when
    importable) and ForkingPickler+base64; tests pass ``bucket_class=None`` to send plain
    ``[(name, tensor)]`` lists of CPU tensors.
    """

    def __init__(
        self,
        bucket_source: BucketSource,
        bucket_class: type | None | str = "auto",
        serialize: Callable[[Any], str] = serialize_for_http,
    ) -> None:
        super().__init__()
        self.bucket_source = bucket_source
        self.bucket_class = bucket_class
        self.serialize = serialize

    def push(self, version: int) -> dict[str, float]:
        if not self.engines:
            raise RuntimeError("SGLangTensorSync.push before connect(engines)")
        start = time.perf_counter()
        begin_update(self.engines)
        nbytes = count = 0
        for named, last in with_last(self.bucket_source()):
            for engine in self.engines:
                requests = build_tensor_requests(
                    named, engine.tp, self.bucket_class, self.serialize
                )
                for req in requests:
                    tag = version if last and req.last else None
                    engine.update_from_tensor(req.payloads, req.load_format, tag)
                # `requests` (and the IPC-shared memory they pin) is dropped only here,
                # after the engine has answered for every one of them.
                del requests
            nbytes += _nbytes(named)
            count += 1
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release the IPC handles the engines closed
        end_update(self.engines, version)
        return _metrics(time.perf_counter() - start, nbytes, count)


@dataclass(frozen=True)
class StageRole:
    """Which part of a distributed push this trainer process does.

    ``sender_stages``: the pipeline stages whose DP=0/TP=0 rank this process is (usually one,
    or none); ``coordinator``: the one process (stage 0's sender) that drives pause / flush /
    continue and checks the version on the engines.
    """

    pp_size: int = 1
    sender_stages: tuple[int, ...] = (0,)
    coordinator: bool = True

    def __post_init__(self) -> None:
        bad = [s for s in self.sender_stages if not 0 <= s < self.pp_size]
        if bad:
            raise ValueError(
                f"StageRole.sender_stages {bad} outside 0..{self.pp_size - 1} (actor.parallel.pp={self.pp_size})"
            )


class SGLangDistributedSync(_SGLangSync):
    """Disaggregated: one process group per pipeline stage, whose sender broadcasts that
    stage's tensors to every engine GPU (NCCL on GPUs; gloo works for CPU tensors).

    ``bucket_source(stage)`` yields the buckets of one stage. ``barrier`` synchronises all
    trainer processes that take part (e.g. a barrier on the policy's world group); with one
    process it can stay None. Every process calls connect/push the same number of times.
    """

    def __init__(
        self,
        bucket_source: Callable[[int], Iterable[Bucket]],
        role: StageRole = StageRole(),
        master_address: str = "127.0.0.1",
        master_ports: dict[int, int] | None = None,
        backend: str = "nccl",
        barrier: Callable[[], None] | None = None,
        group_prefix: str = GROUP_PREFIX,
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        super().__init__()
        self.bucket_source = bucket_source
        self.role = role
        self.master_address = master_address
        self.master_ports = dict(master_ports or {})
        self.backend = backend
        self.barrier = barrier or (lambda: None)
        self.group_prefix = group_prefix
        self.timeout = timeout
        self.groups: dict[int, tuple[StageGroup, Any]] = {}

    def connect(self, engines: Iterable[SGLangEngine]) -> None:
        """(Re)build every stage group; stages join one after another (see module doc)."""
        old = self.engines
        super().connect(engines)
        self._close_groups(old)
        tps = [e.tp for e in self.engines]
        for stage in range(self.role.pp_size):
            if stage in self.role.sender_stages:
                port = self.master_ports.get(stage) or pick_free_port(self.master_address)
                plan = plan_stage_group(tps, stage, self.master_address, port, self.group_prefix)
                self.groups[stage] = (plan, self._open(plan))
            self.barrier()

    def _open(self, plan: StageGroup) -> Any:
        pending = [
            e.init_update_group_async(
                plan.master_address,
                plan.master_port,
                offset,
                plan.world_size,
                plan.name,
                self.backend,
            )
            for e, offset in zip(self.engines, plan.engine_rank_offsets, strict=True)
        ]
        group = open_update_group(
            plan.master_address,
            plan.master_port,
            0,
            plan.world_size,
            plan.name,
            self.backend,
            self.timeout,
        )
        for fut in pending:
            fut.result()
        return group

    def _close_groups(self, engines: Sequence[SGLangEngine]) -> None:
        for plan, group in self.groups.values():
            for engine in engines:
                try:
                    engine.destroy_update_group(plan.name)
                except Exception:  # noqa: BLE001 - a dead engine has no group left to destroy
                    pass
            close_update_group(group)
        self.groups.clear()

    def push(self, version: int) -> dict[str, float]:
        if not self.engines or len(self.groups) != len(self.role.sender_stages):
            raise RuntimeError("SGLangDistributedSync.push before connect(engines)")
        start = time.perf_counter()
        if self.role.coordinator:
            begin_update(self.engines)
        self.barrier()
        nbytes = count = 0
        # With one stage its last bucket carries the version; with several, the coordinator
        # sets it once every stage is in (no single bucket is "the last" of the push).
        single = self.role.pp_size == 1
        for stage in range(self.role.pp_size):
            if stage in self.groups:
                b, c = self._push_stage(stage, version if single else None)
                nbytes, count = nbytes + b, count + c
            self.barrier()
        if self.role.coordinator:
            if not single:
                for engine in self.engines:
                    engine.set_weight_version(version)
            end_update(self.engines, version)
        self.barrier()
        return _metrics(time.perf_counter() - start, nbytes, count)

    def _push_stage(self, stage: int, version: int | None) -> tuple[int, int]:
        plan, group = self.groups[stage]
        nbytes = count = 0
        for named, last in with_last(self.bucket_source(stage)):
            names = [n for n, _ in named]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
            shapes = [list(t.shape) for _, t in named]
            pending = [
                e.update_from_distributed_async(
                    names, dtypes, shapes, plan.name, version if last else None
                )
                for e in self.engines
            ]
            broadcast_tensors(group, [t for _, t in named])
            for fut in pending:
                fut.result()
            nbytes += _nbytes(named)
            count += 1
        return nbytes, count

    def close(self) -> None:
        self._close_groups(self.engines)


class SGLangDiskSync(_SGLangSync):
    """Through a shared filesystem: ``save(version)`` writes an HF checkpoint directory and
    returns its path; every engine loads it with ``/update_weights_from_disk``.

    No pause here: SGLang's disk update waits for running requests itself, and the
    synchronous loop has none in flight when it pushes.
    """

    def __init__(self, save: Callable[[int], str | os.PathLike[str]]) -> None:
        super().__init__()
        self.save = save

    def push(self, version: int) -> dict[str, float]:
        if not self.engines:
            raise RuntimeError("SGLangDiskSync.push before connect(engines)")
        start = time.perf_counter()
        path = Path(self.save(version))
        if not path.is_dir():
            raise FileNotFoundError(
                f"SGLangDiskSync: save({version}) returned {path}, which is not a directory"
            )
        for engine in self.engines:
            engine.resume_memory([WEIGHTS])
            engine.update_from_disk(str(path), version)
            engine.resume_memory([KV_CACHE, CUDA_GRAPH])
            engine.check_weight_version(version)
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return _metrics(time.perf_counter() - start, nbytes, 1)
