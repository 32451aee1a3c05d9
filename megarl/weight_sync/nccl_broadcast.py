"""The NCCL broadcast transport (``rollout.weight_sync.transport: distributed``,
disaggregated SGLang): one update group per pipeline stage, whose DP=0/TP=0 rank broadcasts that
stage's tensors to every engine GPU (``/update_weights_from_distributed``; gloo for CPU tensors
and the CPU SGLang server). The order of calls around a push: megarl/weight_sync/sglang_push.py.

A bucket goes as one broadcast of its bytes (``load_format: "flattened_bucket"``) when every
engine takes it (SGLang >= 0.5.6), else one broadcast per tensor: a collective per tensor costs
its latency hundreds of times per stage (SGLang's PR #13824 measured an 80B model's update at
130 s per tensor and 7 s flattened). The flattened copy is one more bucket on the sender.

Deliberately left out: pushing to a subset of engines, overlapping stages (stages send one
after another: an engine serves one update request at a time, so two stages' broadcasts in
flight on two engines in opposite orders would deadlock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from megarl.rollout_sglang.engine import FLATTENED_BUCKET, EngineEndpoint, SGLangEngine
from megarl.rollout_sglang.server import pick_free_port
from megarl.weight_sync.sglang_push import (
    ABORT,
    EngineFactory,
    engine_client,
    finish_push,
    pause_for_push,
    send_failed,
)
from megarl.weight_sync.stream import WeightStream, sync_metrics
from megarl.weight_sync.update_group import (
    GROUP_PREFIX,
    StageGroup,
    broadcast_tensors,
    close_update_group,
    flattened_bucket,
    open_update_group,
    plan_stage_group,
)


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
                 sum_over_ranks: Callable[[list[float]], list[float]] | None = None, pause: str = ABORT) -> None:  # fmt: skip
        missing = [s for s in role.stages if s not in streams]
        if missing:
            raise ValueError(f"SGLangDistributedTransport: no stream for stages {missing} of {role}")
        self.streams, self.role = dict(streams), role
        self.master_address, self.backend = master_address, backend
        self.barrier = barrier or (lambda: None)
        self.sum_over_ranks = sum_over_ranks or (lambda values: values)
        self.make_engine, self.master_ports = make_engine, dict(master_ports or {})
        self.group_prefix, self.timeout = group_prefix, timeout
        self.pause = pause  # /pause_generation's mode (megarl/weight_sync/sglang_push.py)
        self.engines: list[SGLangEngine] = []
        self.groups: dict[int, tuple[StageGroup, Any]] = {}
        self._flattened: bool | None = None  # every engine takes flattened buckets (read once per connect)

    def connect(self, endpoints: Sequence[EngineEndpoint]) -> None:
        """(Re)build every stage group; stages join one after another (see the module docstring)."""
        self.close()
        self._flattened = None  # restarted engines may run another release
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
            pause_for_push(self.engines, self.pause)
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
                tag = version if tag_last and bucket.last else None
                try:
                    self._send(sender, bucket.tensors, tag)
                except Exception as exc:  # name the receivers: a dead engine shows here as a reset connection
                    raise send_failed(f"pipeline stage {stage}'s weights", self.engines, exc) from exc
            del bucket

    def _send(self, sender: tuple[StageGroup, Any], named: Sequence[tuple[str, Any]], tag: int | None) -> None:
        """One bucket to every engine: the requests, then the broadcast(s) they wait for, then the
        replies. Flattened, the bucket is packed before any engine is asked, so that a failure to
        pack leaves no engine waiting in the group."""
        plan, group = sender
        flat, load_format = None, None
        if self._takes_flattened():
            named, flat = flattened_bucket(named)
            load_format = FLATTENED_BUCKET
        names = [n for n, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        pending = [e.update_from_distributed_async(names, dtypes, shapes, plan.name, tag, load_format)
                   for e in self.engines]  # fmt: skip
        broadcast_tensors(group, [t for _, t in named] if flat is None else [flat])
        for fut in pending:
            fut.result()

    def _takes_flattened(self) -> bool:
        """Whether every engine takes flattened buckets (one broadcast pattern for the group: all
        receivers must expect the same)."""
        if self._flattened is None:
            self._flattened = bool(self.engines) and all(e.takes_flattened_distributed for e in self.engines)
        return self._flattened

    def close(self) -> None:
        self._close_groups(self.engines)
        for engine in self.engines:
            engine.close()  # this rank's client only: the server keeps running
        self.engines = []
