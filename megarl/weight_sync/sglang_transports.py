"""Weight transports to SGLang servers: from tensor (CUDA IPC, colocated) and from distributed
(a broadcast group per pipeline stage, disaggregated). The disk transport is shared with the
torch engine (megarl/weight_sync/transports.py: DiskTransport).

Both implement megarl.weight_sync.transports.WeightTransport and consume the buckets of one
megarl.weight_sync.stream.WeightStream on every policy rank (the export is collective);
they differ only in how a bucket reaches the engines. ``connect(endpoints)`` (collective, again
after an engine restart) gets one :class:`EngineEndpoint` per engine from the controller.

The order of calls to every engine in one push (what a real SGLang server needs; memory is
resumed before the push by the hand-over, megarl/memory/handover.py, not here)::

    pause_generation                  no request runs while weights change
    flush_cache                       retried while SGLang answers 400
    begin_weight_update               on servers that require it (SGLangEngine knows)
    bucket 1 .. bucket k              flush_cache=False each; the last one carries
                                      weight_version
    end_weight_update                 on servers that require it
    continue_generation
    check weight_version              /model_info must report the pushed version

Deliberately left out: pushing to a subset of engines, overlapping stages of the distributed
path (stages send one after another: an engine serves one update request at a time, so two
stages' broadcasts in flight on two engines in opposite orders would deadlock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from megarl.engines.base import WeightBucket
from megarl.weight_sync.stream import WeightStream, sync_metrics
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.server import pick_free_port
from megarl.weight_sync.tensor_payload import build_tensor_requests, serialize_for_http
from megarl.weight_sync.update_group import (
    GROUP_PREFIX,
    StageGroup,
    broadcast_tensors,
    close_update_group,
    open_update_group,
    plan_stage_group,
)


@dataclass(frozen=True)
class EngineEndpoint:
    """How a policy rank reaches one engine (plain data: it travels from the controller).

    ``holders`` (colocated only): the policy ranks on the engine's GPUs, in engine TP order.
    """

    url: str
    tp: int
    max_running_requests: int = 256
    holders: tuple[int, ...] = ()


EngineFactory = Callable[[EngineEndpoint], SGLangEngine]


def engine_client(endpoint: EngineEndpoint) -> SGLangEngine:
    """A policy rank's own client of one engine (it never releases or resumes memory)."""
    return SGLangEngine(endpoint.url, tp=endpoint.tp, max_running_requests=endpoint.max_running_requests)


def send_failed(what: str, engines: Sequence[SGLangEngine], exc: BaseException) -> RuntimeError:
    """The error of a send to ``engines`` that raised ``exc``: the engines named, the cause's
    first line (the push deadline's report and the driver's one-line error carry it)."""
    cause = (str(exc).strip().splitlines() or [""])[0][:160]
    urls = ", ".join(e.url for e in engines)
    return RuntimeError(f"sending {what} to engine(s) {urls} failed: {type(exc).__name__}: {cause}")


def pause_for_push(engines: Sequence[SGLangEngine]) -> None:
    """Steps before the first bucket, on every engine (see the module docstring)."""
    for engine in engines:
        engine.pause_generation()
        engine.flush_cache()
        engine.begin_weight_update()


def finish_push(engines: Sequence[SGLangEngine], version: int) -> None:
    """Steps after the last bucket, on every engine; raises WeightVersionMismatch."""
    for engine in engines:
        engine.end_weight_update()
        engine.continue_generation()
        engine.check_weight_version(version)


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


class SGLangTensorTransport:
    """Colocated: gather TP -> convert to HF -> bucket -> CUDA IPC handles -> SGLang.

    Tensors stay on the trainer's GPUs; SGLang opens them through CUDA IPC. Every policy rank on
    an engine's GPUs serializes its own copy of each bucket from its own GPU (engine TP rank r
    then reads memory on its own device); the copies are gathered over a gloo group of those
    ranks to the first of them, which posts one payload per engine TP rank. Ranks on no engine's
    GPUs only take part in the export.

    ``payload_gather(ranks)`` builds the gather for one engine's holders (default: gloo, made
    collectively by every rank in the same order); ``bucket_class`` and ``serialize`` default to
    SGLang's FlattenedTensorBucket (when importable) and ForkingPickler+base64; the CPU tests pass
    ``bucket_class=None`` (plain ``[(name, tensor)]`` lists).
    """

    def __init__(self, stream: WeightStream, *, rank: int = 0, make_engine: EngineFactory = engine_client,
                 payload_gather: Callable[[list[int]], PayloadGather] | None = None,
                 bucket_class: type | None | str = "auto", serialize: Callable[[Any], str] = serialize_for_http) -> None:  # fmt: skip
        self.stream, self.rank, self.make_engine = stream, rank, make_engine
        self.payload_gather = payload_gather or GlooPayloadGathers()
        self.bucket_class, self.serialize = bucket_class, serialize
        self.engines: list[SGLangEngine] = []  # the engine this rank posts to (at most one)
        self.per_gpu: PayloadGather | None = None
        self.failure: Exception | None = None  # of the current push's posts (per-GPU payloads)

    def connect(self, endpoints: Sequence[EngineEndpoint]) -> None:
        self.close()
        for endpoint in endpoints:
            holders = list(endpoint.holders) or [0]  # none given: rank 0 serves the engine alone
            gather = self.payload_gather(holders) if len(holders) > 1 else None  # collective: every rank
            if self.rank in holders:
                self.per_gpu = gather or self.per_gpu
                if self.rank == holders[0]:
                    self.engines.append(self.make_engine(endpoint))
        if self.per_gpu is not None and len(self.engines) > 1:
            raise ValueError(f"policy rank {self.rank} is on the GPUs of {len(self.engines)} engines; "
                             "an engine's GPUs must hold distinct policy ranks")  # fmt: skip

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        pause_for_push(self.engines)
        self.failure = None
        for bucket in self.stream.buckets(version):
            if self.per_gpu is None:
                self._send_from_here(bucket, version)
            else:
                self._send_per_gpu(bucket, version, self.per_gpu)
            del bucket
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release the IPC handles the engines closed
        if self.failure is not None:
            raise send_failed("weights", self.engines, self.failure) from self.failure
        finish_push(self.engines, version)
        return self.stream.metrics(time.perf_counter() - start)

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
        """The engine's GPUs gather their copies to the poster, which posts them. After a failed
        post the poster still meets the others at every gather and barrier of the push (and
        raises at its end), so they are not left waiting for it."""
        requests = build_tensor_requests(bucket.tensors, 1, self.bucket_class, self.serialize)
        for req in requests:
            payloads = per_gpu.gather(req.payloads[0])
            try:
                if payloads is not None and self.engines and self.failure is None:
                    tag = version if bucket.last and req.last else None
                    self.engines[0].update_from_tensor(payloads, req.load_format, tag)
            except Exception as exc:  # noqa: BLE001 - raised at the end of the push
                self.failure = exc
            finally:
                per_gpu.barrier()  # every copy stays alive until the engine has answered
        del requests

    def close(self) -> None:
        for engine in self.engines:
            engine.close()  # this rank's client only: the server keeps running
        self.engines, self.per_gpu = [], None


class GlooPayloadGathers:
    """``PayloadGather`` over a gloo group of the given policy ranks, one group per rank set
    (made once: every rank must ask for every set, in the same order)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}

    def __call__(self, ranks: list[int]) -> PayloadGather:
        import torch.distributed as dist

        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), backend="gloo")
        group, me, order = self._groups[key], dist.get_rank(), sorted(ranks)

        def gather(payload: str) -> list[str] | None:
            out: list[Any] | None = [None] * len(ranks) if me == ranks[0] else None
            dist.gather_object(payload, out, dst=ranks[0], group=group)
            return None if out is None else [out[order.index(r)] for r in ranks]

        return PayloadGather(gather=gather, barrier=lambda: dist.barrier(group=group))


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


class SGLangDistributedTransport:
    """Disaggregated: gather TP -> convert to HF -> bucket -> broadcast in one group per
    pipeline stage, whose sender (the stage's DP=0/TP=0 rank) is rank 0 and every engine GPU a
    member (NCCL on GPUs; gloo for CPU tensors and the CPU SGLang server).

    ``streams[stage]`` yields the buckets of one stage (an export of that stage only). With an
    exporter that collects every stage on every rank, use ``StageRole(pp_size=1)``: one group,
    rank 0 sends everything. ``barrier`` synchronises every trainer process that takes part
    (None with one process); ``sum_over_ranks`` adds numbers over them (the push's bytes and
    buckets over the stages' senders; None with one process). Every process calls connect /
    push the same number of times.
    """

    def __init__(self, streams: Mapping[int, WeightStream], role: StageRole = StageRole(), *,
                 master_address: str = "127.0.0.1", backend: str = "nccl", barrier: Callable[[], None] | None = None,
                 make_engine: EngineFactory = engine_client, master_ports: Mapping[int, int] | None = None,
                 group_prefix: str = GROUP_PREFIX, timeout: timedelta = timedelta(minutes=10),
                 sum_over_ranks: Callable[[list[float]], list[float]] | None = None) -> None:  # fmt: skip
        missing = [s for s in role.stages if s not in streams]
        if missing:
            raise ValueError(f"SGLangDistributedTransport: no stream for stages {missing} of {role}")
        self.streams, self.role = dict(streams), role
        self.master_address, self.backend = master_address, backend
        self.barrier = barrier or (lambda: None)
        self.sum_over_ranks = sum_over_ranks or (lambda values: values)
        self.make_engine, self.master_ports = make_engine, dict(master_ports or {})
        self.group_prefix, self.timeout = group_prefix, timeout
        self.engines: list[SGLangEngine] = []
        self.groups: dict[int, tuple[StageGroup, Any]] = {}

    def connect(self, endpoints: Sequence[EngineEndpoint]) -> None:
        """(Re)build every stage group; stages join one after another (see the module docstring)."""
        self.close()
        talks = self.role.coordinator or bool(self.role.sender_stages)
        self.engines = [self.make_engine(e) for e in endpoints] if talks else []
        tps = [e.tp for e in endpoints]
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
            raise RuntimeError("SGLangDistributedTransport.push before connect(endpoints)")
        start = time.perf_counter()
        if self.role.coordinator:
            pause_for_push(self.engines)
        self.barrier()
        # With one stage its last bucket carries the version; with several, the coordinator
        # sets it once every stage is in (no single bucket is "the last" of the push).
        single = self.role.pp_size == 1
        progress = self.streams[self.role.stages[0]].progress
        failure: Exception | None = None
        for stage in range(self.role.pp_size):
            if stage in self.role.stages and failure is None:
                try:
                    self._push_stage(stage, version, tag_last=single)
                except Exception as exc:  # noqa: BLE001 - raised below, after the barriers
                    # Still meet the other ranks at every barrier, so that they reach the export
                    # check (where every rank learns of the failure) instead of waiting here for
                    # the deadline. The weight stream finishes this rank's export (dropping the
                    # buckets), so its TP peers get through the stage's gathers too.
                    failure = exc
            progress.mark(version, f"waiting for pipeline stage {stage}'s broadcast to end")
            self.barrier()
        (failed_ranks,) = self.sum_over_ranks([float(failure is not None)])
        if failure is not None:
            raise failure
        if failed_ranks:  # another rank's send failed: the export check names it on every rank
            return sync_metrics(time.perf_counter() - start, 0, 0)
        if self.role.coordinator:
            if not single:
                for engine in self.engines:
                    engine.set_weight_version(version)
            finish_push(self.engines, version)
        seconds = time.perf_counter() - start
        # What the stages' senders sent, over every stage (each rank iterated its own stage).
        sent = [[self.streams[s].pushed_bytes, self.streams[s].pushed_buckets] for s in self.role.sender_stages]
        nbytes, buckets = self.sum_over_ranks([sum(x[0] for x in sent), sum(x[1] for x in sent)])
        return sync_metrics(seconds, int(nbytes), int(buckets))

    def _push_stage(self, stage: int, version: int, tag_last: bool) -> None:
        """Iterate the stage's stream (every rank of the stage); its sender broadcasts."""
        sender = self.groups.get(stage)
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
                try:
                    broadcast_tensors(group, [t for _, t in named])
                    for fut in pending:
                        fut.result()
                except Exception as exc:  # name the receivers: a dead engine shows here as a reset connection
                    raise send_failed(f"pipeline stage {stage}'s weights", self.engines, exc) from exc
            del bucket

    def close(self) -> None:
        self._close_groups(self.engines)
        for engine in self.engines:
            engine.close()  # this rank's client only: the server keeps running
        self.engines = []
