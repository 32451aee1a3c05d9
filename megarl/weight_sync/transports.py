"""Weight transports: how the buckets of a push reach the engines. One class per transport.

Every transport takes the buckets of one :class:`~megarl.weight_sync.stream.WeightStream`
(gather TP -> convert to HF -> bucket) and differs only in how it sends them:

=============  ==========================================  =================================
transport      data path                                    engines
=============  ==========================================  =================================
in_process     bucket -> ``engine.load_weights`` in the     torch engines in the policy ranks
               same process
disk           bucket -> safetensors file -> the engines    torch engines or SGLang servers
               reload the directory                         (a filesystem all ranks share)
tensor         bucket -> CUDA IPC handles -> SGLang         colocated SGLang
               (megarl/weight_sync/cuda_ipc.py)
distributed    bucket -> broadcast in one group per         disaggregated SGLang
               pipeline stage (nccl_broadcast.py)
=============  ==========================================  =================================

All run on every policy rank (the export is collective) with the same three calls:
``connect(endpoints)`` (collective; again after an engine restart), ``push(version) ->
metrics`` (collective), ``close()``. :func:`build_transport` picks the class once, from the
config (``rollout.weight_sync.transport``). Memory hand-over (releasing and resuming engine
memory) is not a transport's business: megarl/memory/handover.py does it around pushes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from megarl.weight_sync.cuda_ipc import SGLangTensorTransport
from megarl.weight_sync.disk import DiskReloadable, DiskTransport
from megarl.weight_sync.in_process import InProcessTransport
from megarl.weight_sync.lora_adapter import AdapterTransport
from megarl.weight_sync.nccl_broadcast import SGLangDistributedTransport, StageRole
from megarl.weight_sync.progress import PushProgress
from megarl.weight_sync.sglang_push import ABORT, RETRACT, RetractingDiskReload, engine_client
from megarl.weight_sync.stream import MIB, WeightStream
from megarl.weight_sync.transport_base import TRANSPORT_COLLECT, GlooGroup, WeightTransport


def build_transport(name: str, policy: Any, *, bucket_mb: float, gather_mb: float, overlap: bool = True,
                    local_engine: Any = None, disk_dir: str | Path | None = None, hf_dir: str | None = None,
                    progress: PushProgress | None = None, node_address: Callable[[], str] | None = None,
                    pause: str = ABORT, lora_adapters: Any = None) -> WeightTransport:  # fmt: skip
    """The transport ``name`` (``rollout.weight_sync.transport``, resolved) for one policy rank.

    ``policy``: the rank's PolicyWorker (``info`` and ``export_weights``); ``overlap``: the
    stream exports the next bucket while one is sent (megarl/weight_sync/stream.py); ``gather_mb``: the
    MiB of tensors one TP all-gather of the export takes (0: one tensor); ``local_engine``:
    the torch engine of this rank (replica leaders), else None; ``progress``: where the stream
    notes each bucket (megarl/weight_sync/progress.py); ``node_address``: gives this node's address as
    engines on other nodes reach it (asked only by the distributed transport, for its update groups);
    ``pause``: how a push pauses SGLang servers (megarl/weight_sync/sglang_push.py ``pause_mode``);
    ``lora_adapters``: the policy's LoRAAdapters in adapter mode (``rollout.weight_sync.lora``), whose
    pushes then carry the adapters only (megarl/weight_sync/lora_adapter.py), else None.
    """
    base = _base_transport(name, policy, bucket_mb=bucket_mb, gather_mb=gather_mb, overlap=overlap,
                           local_engine=local_engine, disk_dir=disk_dir, hf_dir=hf_dir, progress=progress,
                           node_address=node_address, pause=pause)  # fmt: skip
    if lora_adapters is None:
        return base
    if disk_dir is None or hf_dir is None:
        raise ValueError("adapter-mode LoRA pushes need rollout.weight_sync.disk_dir and the base model's path")
    writer = policy.info.rank == 0
    return AdapterTransport(base, lora_adapters, disk_dir, writer=writer, base_model=str(Path(hf_dir).resolve()),
                            engines_of=lambda endpoints: [engine_client(e) for e in endpoints] if writer else [],
                            barrier=GlooGroup().barrier)  # fmt: skip


def _base_transport(name: str, policy: Any, *, bucket_mb: float, gather_mb: float, overlap: bool, local_engine: Any,
                    disk_dir: str | Path | None, hf_dir: str | None, progress: PushProgress | None,
                    node_address: Callable[[], str] | None, pause: str) -> WeightTransport:  # fmt: skip
    """The transport of the whole model (see :func:`build_transport`)."""
    info = policy.info
    collect = TRANSPORT_COLLECT.get(name)  # which ranks receive every stage's tensors
    if collect is None:
        raise ValueError(f"rollout.weight_sync.transport {name!r} is not one of {', '.join(TRANSPORT_COLLECT)}")
    export = partial(policy.export_weights, gather_bytes=int(gather_mb * MIB), collect=collect)
    # In process, "sending" a bucket is the engine's copy in this very thread: there is nothing
    # to overlap the export with, and the prefetch thread's hand-overs only add to the push.
    overlap = overlap and name != "in_process"
    stream = WeightStream(export, bucket_mb, progress=progress, overlap=overlap,
                          observe=partial(policy.export_check.observe, collect=collect))  # fmt: skip
    own = [local_engine] if local_engine is not None else []
    if name == "in_process":
        return InProcessTransport(stream, own)
    if name == "disk":
        if disk_dir is None:
            raise ValueError("the disk transport needs rollout.weight_sync.disk_dir")
        # Torch engines reload in their own ranks; SGLang servers and a torch engine actor of its
        # own (asynchronous runs) are told by the writer (rank 0).
        engines_of = (lambda _: own) if local_engine is not None else _writer_engines(info.rank == 0, pause)
        return DiskTransport(stream, disk_dir, writer=info.rank == 0, hf_dir=hf_dir, engines_of=engines_of,
                             barrier=GlooGroup().barrier)  # fmt: skip
    if name == "tensor":
        return SGLangTensorTransport(stream, rank=info.rank, pause=pause)
    if node_address is None:
        raise ValueError("the distributed transport needs node_address (this node's address for its update groups)")
    return _distributed(policy, stream, node_address(), pause)


def _writer_engines(writer: bool, pause: str) -> Callable[[Any], Sequence[Any]]:
    """The engines the writer reloads: an SGLang endpoint becomes this rank's client of it
    (paused with ``retract`` around the reload while it generates, else SGLang's own wait for the
    requests in flight); an endpoint that reloads by itself (the torch engine actor's client) is
    used as it is."""

    def sglang(endpoint: Any) -> Any:
        client = engine_client(endpoint)
        return RetractingDiskReload(client) if pause == RETRACT else client

    def engines_of(endpoints: Any) -> Sequence[Any]:
        if not writer:
            return []
        return [e if isinstance(e, DiskReloadable) else sglang(e) for e in endpoints]

    return engines_of


def _distributed(policy: Any, stream: WeightStream, master_address: str, pause: str) -> WeightTransport:
    """One group per pipeline stage: each stage exports only its own tensors (no cross-stage
    traffic) and its DP=0/TP=0 rank sends them; rank 0 drives pause / flush / versions."""
    import torch

    info = policy.info
    sender = info.tp_rank == 0 and info.dp_rank == 0
    role = StageRole(pp_size=info.pp_size, stages=(info.pp_rank,), sender_stages=(info.pp_rank,) if sender else (),
                     coordinator=info.rank == 0)  # fmt: skip
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    group = GlooGroup()
    return SGLangDistributedTransport({info.pp_rank: stream}, role, master_address=master_address, backend=backend,
                                      barrier=group.barrier, sum_over_ranks=group.sum, pause=pause)  # fmt: skip
