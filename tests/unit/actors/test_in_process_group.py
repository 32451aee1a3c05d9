"""The in-process worker group's launcher variables: set for the worker when missing, the
caller's kept, and the ones it set removed at shutdown (a process `megarl generate` starts after
an in-process export must not inherit a rank)."""

from __future__ import annotations

import os

import pytest

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
    assert group.call("where") == ["0"]
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
