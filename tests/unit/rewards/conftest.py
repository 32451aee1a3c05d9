"""Shared by the reward-pool tests."""

from __future__ import annotations

import psutil
import pytest


def _still_running(pids: set[int]) -> set[int]:
    """Which of ``pids`` still run below this process (a zombie runs nothing)."""
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in pids and child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def still_running():
    """``still_running(pids)``: which of the worker pids a test saw still run (none should,
    once pebble has stopped them)."""
    return _still_running
