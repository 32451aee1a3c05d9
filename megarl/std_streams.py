"""The process's standard output and error at the descriptor level (fds 1 and 2): pointing one at
/dev/null when its reader is gone, and which file each points at.

megarl points a stream at /dev/null itself (a terminal that hung up, a closed pipe: every write
would fail); user code in the driver that does the same, or closes one, has it put back after its
call (megarl/user_code.py). :func:`moves` tells the two apart: megarl's own moves are counted.
"""

from __future__ import annotations

import os

_MOVES: dict[int, int] = {}  # a descriptor -> how many times megarl pointed it at /dev/null


def to_devnull(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null: a standard stream whose reader left (a pipe's EPIPE, a
    terminal gone: EIO) or that was closed; what is written there from now on goes nowhere."""
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:  # (the lowest free descriptor: fd itself when it was closed and the ones below are open)
        os.dup2(null, fd)
        os.close(null)
    _MOVES[fd] = _MOVES.get(fd, 0) + 1


def moves(fd: int) -> int:
    """How many times megarl pointed ``fd`` at /dev/null (:func:`to_devnull`) so far."""
    return _MOVES.get(fd, 0)


def file_of(fd: int) -> tuple[int, int] | None:
    """The file ``fd`` points at (device, inode); None when it is closed."""
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
