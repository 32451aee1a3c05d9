"""What every weight transport is (the :class:`WeightTransport` protocol), which policy ranks
receive every stage's tensors for each transport (``TRANSPORT_COLLECT``: the planner's push
model reads it too, so this module imports no torch), the version check after a push, and the
policy ranks' own gloo group. The transports themselves: one file each in this folder; the
one place a transport is chosen: megarl/weight_sync/transports.py.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# Which policy ranks receive every pipeline stage's tensors when a push exports them
# (megarl/parallel/stage_collection.py): the replica leader (it holds the torch engine or
# writes the directory), every rank (each serializes its own copy for CUDA IPC), or only the
# stage's own ranks (each stage broadcasts its own tensors).
TRANSPORT_COLLECT = {"in_process": "leader", "disk": "leader", "tensor": "all", "distributed": "stage"}


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


def remove_versions(directory: str | Path, prefix: str, keep: Iterable[int]) -> None:
    """Remove the ``<prefix><N>`` and ``<prefix><N>.tmp`` directories a transport wrote into
    ``directory``, but for the versions ``keep``; nothing else (the directory may hold other things).
    A directory that is not there holds nothing to remove (an adapter push writes none when every
    server is on another host)."""
    if not Path(directory).is_dir():
        return
    pattern, kept = re.compile(rf"{re.escape(prefix)}(\d+)(\.tmp)?"), set(keep)
    for old in Path(directory).iterdir():
        match = pattern.fullmatch(old.name)
        if match and (match.group(2) is not None or int(match.group(1)) not in kept):
            shutil.rmtree(old, ignore_errors=True)


class GlooGroup:
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
