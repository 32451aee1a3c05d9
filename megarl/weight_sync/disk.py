"""The disk transport: each push becomes an HF directory that the engines (torch engines or
SGLang servers) reload; the directory must be on a filesystem every engine can read."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megarl.models.hf_files import copy_side_files
from megarl.weight_sync.stream import WeightStream
from megarl.weight_sync.transport_base import check_versions, remove_versions


@runtime_checkable
class DiskReloadable(Protocol):
    """An engine client that reloads a pushed directory itself (and has a ``weight_version``),
    such as the torch engine actor's (megarl/engines/engine_actor.py)."""

    def load_weights_from_disk(self, directory: str | Path, version: int) -> None: ...


class DiskTransport:
    """Each push becomes an HF directory ``directory/v<version>`` (one safetensors file per
    bucket, config and tokenizer copied from ``hf_dir``), which the engines reload.

    ``writer``: whether this rank writes (rank 0: it holds full tensors); every rank takes part
    in the export. ``barrier``: synchronises the policy ranks so engines in other ranks load
    only a complete directory, and older directories are removed only once nobody reads them.
    ``engines_of(endpoints)`` gives the engines this rank reloads (torch engines in the replica
    leaders; the SGLang servers, or the torch engine actor of an asynchronous run, on the writer). The directory must be on a filesystem every
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
        try:
            for engine in self.engines:
                engine.load_weights_from_disk(target, version)
            check_versions(self.engines, version)
        finally:  # a failed reload (a dead engine) still meets the others, who then learn of it at once
            self.barrier()  # nobody reads an older version any more
        if self.writer:  # older versions this transport wrote
            remove_versions(self.directory, "v", keep=[version])
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
