"""A Ray rank's log file: the line each rank writes first, whether a log says more than that,
and its lines less the library warnings (what an error quotes of it).

Every rank (megarl/ray_cluster/worker_group.py) starts its log with one line naming itself and
what it builds; a rank killed right after (a ``kill -9``, the OOM killer) leaves that line alone.
A folder of rank logs that a command removes when they say nothing (`megarl convert`'s, in /tmp)
counts such a log as saying nothing. A rank's log holds torch's and Megatron's warnings too
(``UserWarning``, ``FutureWarning``, each with its source line): the log keeps them, the tail an
error quotes leaves them out (:func:`without_warnings`), so it shows what the rank did last.
"""

from __future__ import annotations

import re
from pathlib import Path

START_LINE = "[megarl] rank {rank} pid {pid}: building {name}"  # a rank's first line (its own stdout)
_START = re.compile(r"\[megarl\] rank \S+ pid \d+: building \S+")
_READ = 65536  # a log longer than this says something whatever it begins with
# A warning as Python's warnings module prints it ("<file>:<line>: <Category>: <message>", its
# category's name ending in Warning) or as torch's C++ code does ("[W<when> <file>:<line>] Warning: ...").
_WARNING = re.compile(r"^\S.*:\d+: [\w.]*Warning: |^\[W[^\]]*\] Warning: ")


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


def without_warnings(lines: list[str]) -> list[str]:
    """``lines`` of a log less its warnings: each warning's line and the indented lines right after
    it (the source line Python prints under it). A traceback's indented lines follow no warning
    line, so they stay."""
    kept: list[str] = []
    in_warning = False
    for line in lines:
        if _WARNING.match(line):
            in_warning = True
        elif not (in_warning and line[:1].isspace() and line.strip()):
            in_warning = False
            kept.append(line)
    return kept
