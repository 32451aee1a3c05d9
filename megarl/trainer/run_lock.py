"""One run per output directory: a second `megarl launch` (a Slurm requeue while the old job is
still alive, a command started twice) on the same ``trainer.output_dir`` would resume from the
first one's checkpoints while it trains, save over its steps and cut its metrics.jsonl.

The lock is a POSIX record lock (``lockf``) on ``<output_dir>/.megarl.lock``, held by the driver
for the whole run: the kernel releases it when the process ends however it ends (no stale lock
after a SIGKILL), processes the driver forks (a reward pool) do not inherit it, unlike
``flock``'s, and NFS honours it. Being the process's own, it does not stop a second hold from
the same process. The file names its holder for the refusal; it stays in place (removing it
while another process opens it would let two runs lock two different files).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".megarl.lock"


class OutputDirInUse(RuntimeError):
    """Another live process runs in this output directory."""


@contextmanager
def output_dir_lock(output_dir: str | Path, field: str = "trainer.output_dir") -> Iterator[None]:
    """Hold ``output_dir`` for this process; refuse (OutputDirInUse naming the holder) when
    another process holds it. ``field`` names the config key in the message."""
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
            raise OutputDirInUse(f"{field} {output_dir} is in use by {holder}; wait for that run to end or stop it, "
                                 f"or give another {field}") from None  # fmt: skip
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {since})".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
