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
               (megarl/weight_sync/sglang_transports.py)
distributed    bucket -> broadcast in one group per         disaggregated SGLang
               pipeline stage (same module)
=============  ==========================================  =================================

All run on every policy rank (the export is collective) with the same three calls:
``connect(endpoints)`` (collective; again after an engine restart), ``push(version) ->
metrics`` (collective), ``close()``. :func:`build_transport` picks the class once, from the
config (``rollout.weight_sync.transport``). Memory hand-over (releasing and resuming engine
memory) is not a transport's business: megarl/memory/handover.py does it around pushes.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megarl.plan.push_model import TRANSPORT_COLLECT
from megarl.models.hf_files import copy_side_files
from megarl.engines.base import RolloutEngine
from megarl.weight_sync.progress import PushProgress
from megarl.weight_sync.stream import MIB, WeightStream


@runtime_checkable
class WeightTransport(Protocol):
    """The only way weights move from the trainer to the engines (see the module docstring)."""

    def connect(self, endpoints: Any) -> None: ...

    def push(self, version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class VersionedEngine(Protocol):
    @property
    def weight_version(self) -> int: ...


def check_versions(engines: Iterable[VersionedEngine], version: int) -> None:
    """Every engine must report ``version`` after a push, or the push did not complete."""
    for i, engine in enumerate(engines):
        if engine.weight_version != version:
            raise RuntimeError(
                f"engine {i} reports weight_version {engine.weight_version} after push {version}; "
                "the push did not complete (see the engine's log)"
            )


class InProcessTransport:
    """Buckets straight into the torch engines living in this process (``engine.load_weights``).

    Ranks without an engine connect an empty list and only take part in the export.
    """

    def __init__(self, stream: WeightStream, local_engines: Sequence[RolloutEngine] = ()) -> None:
        self.stream = stream
        self.local_engines = list(local_engines)
        self.engines: list[RolloutEngine] = []

    def connect(self, endpoints: Any = None) -> None:
        """The engines are this process's own (``endpoints`` is unused: nothing to reach)."""
        self.engines = list(self.local_engines)

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        for bucket in self.stream.buckets(version):
            for engine in self.engines:
                engine.load_weights(bucket)
            del bucket
        check_versions(self.engines, version)
        return self.stream.metrics(time.perf_counter() - start)

    def close(self) -> None:
        self.engines = []


_VERSION_DIR = re.compile(r"v\d+(\.tmp)?")  # what DiskTransport writes into its directory

class DiskTransport:
    """Each push becomes an HF directory ``directory/v<version>`` (one safetensors file per
    bucket, config and tokenizer copied from ``hf_dir``), which the engines reload.

    ``writer``: whether this rank writes (rank 0: it holds full tensors); every rank takes part
    in the export. ``barrier``: synchronises the policy ranks so engines in other ranks load
    only a complete directory, and older directories are removed only once nobody reads them.
    ``engines_of(endpoints)`` gives the engines this rank reloads (torch engines in the replica
    leaders; the SGLang servers on the writer). The directory must be on a filesystem every
    engine can read.
    """

    def __init__(self, stream: WeightStream, directory: str | Path, *, writer: bool, hf_dir: str | Path | None,
                 engines_of: Callable[[Any], Sequence[Any]], barrier: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        self.stream = stream
        self.directory = Path(directory)
        self.writer, self.barrier, self.engines_of = writer, barrier, engines_of
        self.hf_dir = Path(hf_dir) if hf_dir is not None else None
        self.engines: list[Any] = []

    def connect(self, endpoints: Any = None) -> None:
        self.engines = list(self.engines_of(endpoints))

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        target, tmp = self.directory / f"v{version}", self.directory / f"v{version}.tmp"
        if self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        for i, bucket in enumerate(self.stream.buckets(version)):
            if self.writer:
                _save_bucket(bucket.tensors, tmp / f"model-{i:05d}.safetensors")
            del bucket
        if self.writer:
            self._publish(tmp, target)
        self.barrier()  # the directory is complete before any engine reads it
        for engine in self.engines:
            engine.load_weights_from_disk(target, version)
        check_versions(self.engines, version)
        self.barrier()  # nobody reads an older version any more
        if self.writer:  # older versions this transport wrote (v<N> only: the directory may hold other things)
            for old in self.directory.iterdir():
                if old != target and _VERSION_DIR.fullmatch(old.name):
                    shutil.rmtree(old, ignore_errors=True)
        return self.stream.metrics(time.perf_counter() - start)

    def _publish(self, tmp: Path, target: Path) -> None:
        if self.hf_dir is not None:
            copy_side_files(self.hf_dir, tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # atomic: an engine never sees a half-written version

    def close(self) -> None:
        self.engines = []


def _save_bucket(tensors: Sequence[tuple[str, Any]], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().cpu() for name, t in tensors}, str(path))


def build_transport(name: str, policy: Any, *, bucket_mb: float, gather_mb: float, overlap: bool = True,
                    local_engine: Any = None, disk_dir: str | Path | None = None, hf_dir: str | None = None,
                    progress: PushProgress | None = None) -> WeightTransport:  # fmt: skip
    """The transport ``name`` (``rollout.weight_sync.transport``, resolved) for one policy rank.

    ``policy``: the rank's PolicyWorker (``info`` and ``export_weights``); ``overlap``: the
    stream exports the next bucket while one is sent (megarl/weight_sync/stream.py); ``gather_mb``: the
    MiB of tensors one TP all-gather of the export takes (0: one tensor); ``local_engine``:
    the torch engine of this rank (replica leaders), else None; ``progress``: where the stream
    notes each bucket (megarl/weight_sync/progress.py).
    """
    info = policy.info
    collect = TRANSPORT_COLLECT.get(name)  # which ranks receive every stage's tensors
    if collect is None:
        raise ValueError(f"rollout.weight_sync.transport {name!r} is not one of {', '.join(TRANSPORT_COLLECT)}")
    export = partial(policy.export_weights, gather_bytes=int(gather_mb * MIB), collect=collect)
    stream = WeightStream(export, bucket_mb, progress=progress, overlap=overlap,
                          observe=partial(policy.export_check.observe, collect=collect))  # fmt: skip
    own = [local_engine] if local_engine is not None else []
    if name == "in_process":
        return InProcessTransport(stream, own)
    if name == "disk":
        if disk_dir is None:
            raise ValueError("the disk transport needs rollout.weight_sync.disk_dir")
        # Torch engines reload in their own ranks; SGLang servers are told by the writer (rank 0).
        engines_of = (lambda _: own) if local_engine is not None else _sglang_writer_engines(info.rank == 0)
        return DiskTransport(stream, disk_dir, writer=info.rank == 0, hf_dir=hf_dir, engines_of=engines_of,
                             barrier=_GlooGroup().barrier)  # fmt: skip
    if name == "tensor":
        from megarl.weight_sync.sglang_transports import SGLangTensorTransport

        return SGLangTensorTransport(stream, rank=info.rank)
    return _distributed(policy, stream)


def _sglang_writer_engines(writer: bool) -> Callable[[Any], Sequence[Any]]:
    def engines_of(endpoints: Any) -> Sequence[Any]:
        from megarl.weight_sync.sglang_transports import engine_client

        return [engine_client(e) for e in endpoints] if writer else []

    return engines_of


def _distributed(policy: Any, stream: WeightStream) -> WeightTransport:
    """One group per pipeline stage: each stage exports only its own tensors (no cross-stage
    traffic) and its DP=0/TP=0 rank sends them; rank 0 drives pause / flush / versions."""
    import torch

    from megarl.weight_sync.sglang_transports import SGLangDistributedTransport, StageRole

    info = policy.info
    sender = info.tp_rank == 0 and info.dp_rank == 0
    role = StageRole(pp_size=info.pp_size, stages=(info.pp_rank,), sender_stages=(info.pp_rank,) if sender else (),
                     coordinator=info.rank == 0)  # fmt: skip
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    group = _GlooGroup()
    return SGLangDistributedTransport({info.pp_rank: stream}, role, master_address=node_address(), backend=backend,
                                      barrier=group.barrier, sum_over_ranks=group.sum)  # fmt: skip


class _GlooGroup:
    """The policy ranks on a gloo group (made when a transport is built: every rank builds its
    transport at the same point), so its barriers never queue behind NCCL work on the GPUs."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return total.tolist()



def node_address() -> str:
    """This node's address as engines on other nodes reach it (Ray's view when Ray runs)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    return socket.gethostbyname(socket.gethostname())
