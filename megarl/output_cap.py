"""A size cap on the log files the user's code prints into (reward.output_log_max_mb): a reward
function that prints megabytes a call would otherwise fill the disk with no word.

The reward workers write to their log through file descriptors of their own (fds 1 and 2 dup'd
to it, O_APPEND), which the trainer cannot stop: :func:`enforce` cuts the file back to the cap
from outside, after each scoring call and while one waits, and writes one marker line there; the
workers' later writes land after it (O_APPEND) and are cut again at the next look, back to the
cap and the marker, whichever process wrote them (between two looks the file may be longer). The driver's
own user-code log (megarl/user_code.py) is written by megarl itself and stops writing at the cap
(:func:`marker` and :func:`warn_once` give it the same words). Either way one warning, once per
file in a process.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

MB = 1 << 20
KEY = "reward.output_log_max_mb"
log = logging.getLogger(__name__)

_lock = threading.Lock()
_capped: dict[str, int] = {}  # a capped file -> its size with the marker: anything past it is cut
_warned: set[str] = set()


def marker(who: str, max_mb: float) -> str:
    """The line that ends a capped log (``who``: "reward functions", "user code")."""
    whose = f"{who}'" if who.endswith("s") else f"{who}'s"
    return f"\n[megarl: {whose} output past {max_mb:g} MB dropped from here]\n"


def warn_once(path: Path, who: str, max_mb: float) -> None:
    """The terminal's one warning for ``path``: what printed too much, what is kept, the fix."""
    with _lock:
        if str(path) in _warned:
            return
        _warned.add(str(path))
    log.warning("%s printed more than %g MB: %s keeps the first %g MB; print less (or raise %s)", who, max_mb, path, max_mb, KEY)


def enforce(path: Path | None, max_mb: float, who: str) -> None:
    """``path`` cut back to ``max_mb`` MB (0: no cap) with the marker line at the cut, once it grew
    past it; past the marker, cut again. Errors of the file (removed, a full disk) are ignored:
    the cap never fails a scoring call."""
    if path is None or max_mb <= 0:
        return
    limit = int(max_mb * MB)
    key = str(path)
    try:
        size = path.stat().st_size
        with _lock:
            capped = _capped.get(key)
            if capped is not None:
                if size > capped:
                    os.truncate(path, capped)
                return
            if size <= limit:
                return
            _capped[key] = _cut(path, limit, marker(who, max_mb).encode())
    except OSError:
        return
    warn_once(path, who, max_mb)


def _cut(path: Path, limit: int, line: bytes) -> int:
    """``path`` made its first ``limit`` bytes and ``line``; returns that size. The workers go on
    appending meanwhile: the line is written at its offset, not appended (an append would land
    after theirs), and the size is computed, not read back (a stat would count what they appended
    since, which every later cut would then keep: issue, 6 MB past a 1 MB cap)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, line, limit)  # over what was appended past the limit (the file is longer than it)
        os.ftruncate(fd, limit + len(line))
    finally:
        os.close(fd)
    return limit + len(line)
