"""The CUDA IPC transport (``rollout.weight_sync.transport: tensor``, colocated SGLang): each
bucket's tensors stay on the trainer's GPUs and SGLang opens them through CUDA IPC handles
(``/update_weights_from_tensor``, one payload per engine TP rank). The order of calls around a
push: megarl/weight_sync/sglang_push.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.engines.base import WeightBucket
from megarl.rollout_sglang.engine import EngineEndpoint, SGLangEngine
from megarl.rollout_sglang.tensor_payload import build_tensor_requests, serialize_for_http
from megarl.weight_sync.sglang_push import (
    ABORT,
    EngineFactory,
    engine_client,
    finish_push,
    pause_for_push,
    send_failed,
)
from megarl.weight_sync.stream import WeightStream


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
                 bucket_class: type | None | str = "auto", serialize: Callable[[Any], str] = serialize_for_http,
                 pause: str = ABORT) -> None:  # fmt: skip
        self.pause = pause  # /pause_generation's mode (megarl/weight_sync/sglang_push.py)
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
        pause_for_push(self.engines, self.pause)
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
