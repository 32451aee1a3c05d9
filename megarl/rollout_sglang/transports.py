"""WeightSync transports to SGLang engines: from tensor (CUDA IPC), from distributed (NCCL),
from disk. Each implements megarl.rollout.engine.WeightSync: ``connect(engines)`` then
``push(version) -> metrics`` (the keys of megarl.rollout.weight_sync.sync_metrics).

Data path (shared, not here): megarl.rollout.weight_sync.HFWeightStream turns the policy's
HF export into WeightBuckets of ``bucket_mb``; every policy rank iterates it (the export is
collective) and only ranks with engines connected send. Only the send differs per class.

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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from megarl.rollout.engine import WeightBucket
from megarl.rollout.weight_sync import DiskWeightSync, sync_metrics
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


class BucketStream(Protocol):
    """What a transport reads: megarl.rollout.weight_sync.HFWeightStream implements it."""

    def buckets(self, version: int) -> Iterable[WeightBucket]: ...


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
    return sync_metrics(seconds, nbytes) | {"weight_sync/buckets": float(buckets)}


class _SGLangSync:
    """What the three transports share: the engine list and recovery after a restart."""

    engines: list[Any]

    def __init__(self) -> None:
        self.engines = []

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
        For one trainer process. With several (a distributed push), the controller decides:
        it restarts the dead engines once (``SGLangEngine.restart``), then calls
        ``connect`` and ``push`` on every process, since both are collective.
        """
        dead = [e for e in self.engines if not e.health().alive]
        for engine in dead:
            engine.restart(timeout)
        if dead:
            self.connect(self.engines)
            self.push(version)
        return dead


@dataclass(frozen=True)
class PayloadGather:
    """Per-GPU producers for one engine (how slime feeds a TP > 1 engine).

    Every trainer process on the engine's GPUs serializes its own copy of each bucket, from
    its own GPU, so engine TP rank r opens memory on its own device (no peer access, no
    CUDA context on another GPU). ``gather(payload)`` collects one payload per process over
    the engine's GPU group, ordered by engine TP rank, and returns the list on the process
    that posts (the one connected to the engine) and None elsewhere, e.g. with
    ``dist.gather_object`` on a gloo group. ``barrier()`` on the same group runs after the
    post, so no process frees its copy before the engine has read it.
    """

    gather: Callable[[str], list[str] | None]
    barrier: Callable[[], None]


class SGLangTensorSync(_SGLangSync):
    """Colocated: tensors stay on the trainer's GPU and reach SGLang as CUDA IPC handles.

    Every policy rank calls :meth:`push` (the stream's export is collective); the process
    that posts to an engine connects it, the others connect an empty list. Without
    ``per_gpu`` one process serializes each bucket once per engine TP rank from its own GPU
    (the engine's other ranks then read it over peer access); with ``per_gpu`` each GPU's
    process contributes its own copy (see :class:`PayloadGather`). ``bucket_class`` and
    ``serialize`` default to SGLang's FlattenedTensorBucket (when importable) and
    ForkingPickler+base64; the CPU tests pass ``bucket_class=None`` (plain ``[(name,
    tensor)]`` lists).
    """

    def __init__(
        self,
        stream: BucketStream,
        bucket_class: type | None | str = "auto",
        serialize: Callable[[Any], str] = serialize_for_http,
        per_gpu: PayloadGather | None = None,
    ) -> None:
        super().__init__()
        self.stream = stream
        self.bucket_class = bucket_class
        self.serialize = serialize
        self.per_gpu = per_gpu

    def connect(self, engines: Iterable[SGLangEngine]) -> None:
        super().connect(engines)
        if self.per_gpu is not None and len(self.engines) > 1:
            raise ValueError(
                "SGLangTensorSync with per_gpu payloads posts to one engine per process; "
                f"got {len(self.engines)} engines (connect each engine in its own leader process)"
            )

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.engines:
            begin_update(self.engines)
        nbytes = count = 0
        for bucket in self.stream.buckets(version):
            if self.per_gpu is None:
                self._send_from_here(bucket, version)
            else:
                self._send_per_gpu(bucket, version, self.per_gpu)
            nbytes += bucket.nbytes
            count += 1
            del bucket
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release the IPC handles the engines closed
        if self.engines:
            end_update(self.engines, version)
        return _metrics(time.perf_counter() - start, nbytes, count)

    def _send_from_here(self, bucket: WeightBucket, version: int) -> None:
        for engine in self.engines:
            requests = build_tensor_requests(
                bucket.tensors, engine.tp, self.bucket_class, self.serialize
            )
            for req in requests:
                tag = version if bucket.last and req.last else None
                engine.update_from_tensor(req.payloads, req.load_format, tag)
            # `requests` (and the IPC-shared memory they pin) is dropped only here, after
            # the engine has answered for every one of them.
            del requests

    def _send_per_gpu(self, bucket: WeightBucket, version: int, per_gpu: PayloadGather) -> None:
        requests = build_tensor_requests(bucket.tensors, 1, self.bucket_class, self.serialize)
        for req in requests:
            payloads = per_gpu.gather(req.payloads[0])
            if payloads is not None and self.engines:
                tag = version if bucket.last and req.last else None
                self.engines[0].update_from_tensor(payloads, req.load_format, tag)
            per_gpu.barrier()  # every copy stays alive until the engine has answered
        del requests


@dataclass(frozen=True)
class StageRole:
    """Which part of a distributed push this trainer process does.

    ``stages``: the pipeline stages this process exports (normally its own pp rank; all its
    stage's ranks iterate the stream because the export gathers TP shards collectively);
    ``sender_stages``: the stages whose DP=0/TP=0 rank this process is (it joins that
    stage's group as rank 0 and broadcasts); ``coordinator``: the one process (stage 0's
    sender) that drives pause / flush / continue and checks the version on the engines.
    """

    pp_size: int = 1
    stages: tuple[int, ...] = (0,)
    sender_stages: tuple[int, ...] = (0,)
    coordinator: bool = True

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if not 0 <= s < self.pp_size]
        if bad:
            raise ValueError(
                f"StageRole.stages {bad} outside 0..{self.pp_size - 1} (actor.parallel.pp={self.pp_size})"
            )
        if not set(self.sender_stages) <= set(self.stages):
            raise ValueError(
                f"StageRole.sender_stages {list(self.sender_stages)} must be among stages {list(self.stages)}"
            )


class SGLangDistributedSync(_SGLangSync):
    """Disaggregated: one process group per pipeline stage, whose sender broadcasts that
    stage's tensors to every engine GPU (NCCL on GPUs; gloo works for CPU tensors).

    ``streams[stage]`` yields the buckets of one stage (an HFWeightStream over that stage's
    export). With an exporter that already collects every stage on every rank, use
    ``StageRole(pp_size=1)``: one group, rank 0 sends everything. ``barrier`` synchronises
    all trainer processes that take part (e.g. a barrier on the policy's world group); with
    one process it can stay None. Every process calls connect / push the same number of times.
    """

    def __init__(
        self,
        streams: Mapping[int, BucketStream],
        role: StageRole = StageRole(),
        master_address: str = "127.0.0.1",
        master_ports: Mapping[int, int] | None = None,
        backend: str = "nccl",
        barrier: Callable[[], None] | None = None,
        group_prefix: str = GROUP_PREFIX,
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        super().__init__()
        missing = [s for s in role.stages if s not in streams]
        if missing:
            raise ValueError(f"SGLangDistributedSync: no stream for stages {missing} of {role}")
        self.streams = dict(streams)
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
        if set(self.groups) != set(self.role.sender_stages) or (self.groups and not self.engines):
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
            if stage in self.role.stages:
                b, c = self._push_stage(stage, version, tag_last=single)
                nbytes, count = nbytes + b, count + c
            self.barrier()
        if self.role.coordinator:
            if not single:
                for engine in self.engines:
                    engine.set_weight_version(version)
            end_update(self.engines, version)
        self.barrier()
        return _metrics(time.perf_counter() - start, nbytes, count)

    def _push_stage(self, stage: int, version: int, tag_last: bool) -> tuple[int, int]:
        """Iterate the stage's stream (every rank of the stage); its sender broadcasts."""
        sender = self.groups.get(stage)
        nbytes = count = 0
        for bucket in self.streams[stage].buckets(version):
            if sender is not None:
                plan, group = sender
                named = bucket.tensors
                tag = version if tag_last and bucket.last else None
                pending = [
                    e.update_from_distributed_async(
                        [n for n, _ in named],
                        [str(t.dtype).removeprefix("torch.") for _, t in named],
                        [list(t.shape) for _, t in named],
                        plan.name,
                        tag,
                    )
                    for e in self.engines
                ]
                broadcast_tensors(group, [t for _, t in named])
                for fut in pending:
                    fut.result()
            nbytes += bucket.nbytes
            count += 1
            del bucket
        return nbytes, count

    def close(self) -> None:
        self._close_groups(self.engines)


class SGLangDiskSync(DiskWeightSync, _SGLangSync):
    """Through a shared filesystem: the shared DiskWeightSync writes each push as an HF
    directory and calls :meth:`SGLangEngine.load_weights_from_disk` on every engine (which
    resumes memory, posts ``/update_weights_from_disk`` and checks the version).

    ``hf_dir`` is required here: SGLang loads the directory as a model, so it needs the
    config and tokenizer files next to the weights.
    """

    def __init__(
        self, stream: BucketStream, directory: str, *, hf_dir: str, writer: bool = True
    ) -> None:
        DiskWeightSync.__init__(self, stream, directory, writer=writer, hf_dir=hf_dir)  # type: ignore[arg-type]

    def connect(self, engines: Iterable[SGLangEngine]) -> None:
        _SGLangSync.connect(self, engines)
