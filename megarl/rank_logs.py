"""A Ray rank's log file: the line each rank writes first, and whether a log says more than that.

Every rank (megarl/ray_cluster/worker_group.py) starts its log with one line naming itself and
what it builds; a rank killed right after (a ``kill -9``, the OOM killer) leaves that line alone.
A folder of rank logs that a command removes when they say nothing (`megarl convert`'s, in /tmp)
counts such a log as saying nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

START_LINE = "[megarl] rank {rank} pid {pid}: building {name}"  # a rank's first line (its own stdout)
_START = re.compile(r"\[megarl\] rank \S+ pid \d+: building \S+")
_READ = 65536  # a log longer than this says something whatever it begins with


def says_something(path: str | Path) -> bool:
    """Whether the log at ``path`` holds anything beyond the ranks' own start lines (False for a
    log that cannot be read: one removed meanwhile says nothing left to keep)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_READ + 1)
    except OSError:
        return False
    if len(data) > _READ:
        return True
    lines = data.decode(errors="replace").splitlines()
    return any(line.strip() and not _START.fullmatch(line.strip()) for line in lines)
