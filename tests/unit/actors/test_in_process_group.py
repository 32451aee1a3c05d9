"""The in-process worker group's launcher variables: set for the worker when missing, the
caller's kept, and the ones it set removed at shutdown (a process `megarl generate` starts after
an in-process export must not inherit a rank); a worker stopped before it made a process group
ends in the stop itself (a Ctrl-C while it imported Megatron must end in `megarl convert
--in-process`'s "stopped by SIGINT" line, not in an error of a second, failing import of Megatron
while the group cleans up); what the rank raises is a WorkerError, told in one line as a Ray
group's rank's is (a broken invariant: a bug, shown whole)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megarl.actors.clients import InProcessGroup

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Worker:
    def __init__(self) -> None:
        self.env = {key: os.environ.get(key) for key in LAUNCHER}  # what a rank's set-up reads

    def where(self) -> str:
        return self.env["RANK"]


def test_the_variables_it_sets_are_removed_at_shutdown_and_the_callers_stay(monkeypatch):
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # the caller's
    group = InProcessGroup(_Worker)
    assert group.call(_Worker.where) == ["0"]
    env = group.worker.env
    assert (env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "0", "10.0.0.1") and int(env["MASTER_PORT"]) > 0
    group.shutdown()
    assert {key: os.environ.get(key) for key in LAUNCHER} == {**dict.fromkeys(LAUNCHER), "MASTER_ADDR": "10.0.0.1"}


def test_a_world_of_several_is_refused_and_sets_nothing(monkeypatch):
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="runs one rank, but WORLD_SIZE is 2"):
        InProcessGroup(_Worker)
    assert [key for key in LAUNCHER if key in os.environ] == ["WORLD_SIZE"]


def _stopped_while_importing() -> None:
    raise KeyboardInterrupt  # as the signal handler raises it inside the worker's imports


def test_a_worker_stopped_before_its_process_group_ends_in_the_stop(monkeypatch):
    assert not torch.distributed.is_initialized()
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    # Megatron half-imported by the interrupted import: importing it again fails.
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(KeyboardInterrupt):
        InProcessGroup(_stopped_while_importing)
    assert not torch.distributed.is_initialized() and not any(key in os.environ for key in LAUNCHER)


class _Fragile:
    def __init__(self, fail: bool = False) -> None:
        if fail:  # as a torn checkpoint file does, deep in a load
            raise RuntimeError("while loading the checkpoint\nunpickling failed: invalid load key")

    def boom(self, key: str) -> None:
        raise KeyError(key)

    def broken(self) -> None:
        raise AssertionError("an invariant")


def test_what_the_rank_raises_is_one_line_and_a_broken_invariant_is_a_bug(monkeypatch):
    from megarl.cli import user_error_line
    from megarl.ray_cluster.worker_error import WorkerError

    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(WorkerError) as info:
        InProcessGroup(_Fragile, fail=True)
    assert user_error_line(info.value) == ("the rank in this process raised RuntimeError in _Fragile.__init__: unpickling "
                                           "failed: invalid load key")  # fmt: skip
    assert "RANK" not in os.environ  # the failed start cleaned up too
    group = InProcessGroup(_Fragile)
    with pytest.raises(WorkerError) as info:
        group.call_each(_Fragile.boom, [("step",)])
    assert isinstance(info.value.cause, KeyError) and info.value.__cause__ is info.value.cause  # its traceback
    assert user_error_line(info.value) == "the rank in this process raised KeyError in _Fragile.boom: 'step'"
    with pytest.raises(WorkerError) as info:
        group.call(_Fragile.broken)
    assert user_error_line(info.value) is None  # the CLI prints the whole story
    group.shutdown()
