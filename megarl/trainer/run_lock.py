"""One run per output directory: a second `megarl launch` (a Slurm requeue while the old job is
still alive, a command started twice) on the same ``trainer.output_dir`` would resume from the
first one's checkpoints while it trains, save over its steps and cut its metrics.jsonl.

The lock is a POSIX record lock (``lockf``) on ``<output_dir>/.megarl.lock``, held by the driver
for the whole run: the kernel releases it when the process ends however it ends (no stale lock
after a SIGKILL), processes the driver forks (a reward pool) do not inherit it, unlike
``flock``'s, and NFS honours it. Being the process's own, it does not stop a second hold from
the same process and is dropped when the process closes any descriptor of the file: so a second
hold in one process is refused here (a registry of held paths), and nothing else opens the file.
The file names its holder for the refusal; it stays in place (removing it while another process
opens it would let two runs lock two different files). Where the filesystem has no record locks
(some Lustre and NFS mounts), the run goes on unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".megarl.lock"
log = logging.getLogger(__name__)


class OutputDirInUse(RuntimeError):
    """Another live process runs in this output directory."""


_HELD: set[Path] = set()  # the lock files this process holds
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # a filesystem without record locks


@contextmanager
def output_dir_lock(output_dir: str | Path, field: str = "trainer.output_dir") -> Iterator[None]:
    """Hold ``output_dir`` for this process; refuse (OutputDirInUse naming the holder) when
    another process, or this one, holds it. ``field`` names the config key in the message."""
    path = Path(output_dir)
    path.mkdir(parents=True, exist_ok=True)
    lock = (path / LOCK_FILE).resolve()
    if lock in _HELD:
        raise _in_use(field, output_dir, "this process")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)  # umask decides: a group-writable output_dir stays shared
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                log.warning("%s %s: the filesystem has no file locks (%s); nothing stops a second run there",
                            field, output_dir, exc.strerror)  # fmt: skip
            elif exc.errno in (errno.EACCES, errno.EAGAIN):
                holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
                raise _in_use(field, output_dir, holder) from None
            else:
                raise
        else:
            os.ftruncate(fd, 0)
            since = time.strftime("%Y-%m-%d %H:%M:%S")
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {since})".encode(), 0)
        _HELD.add(lock)
        try:
            yield
        finally:
            _HELD.discard(lock)
    finally:
        os.close(fd)  # releases the lock


def _in_use(field: str, output_dir: str | Path, holder: str) -> OutputDirInUse:
    return OutputDirInUse(f"{field} {output_dir} is in use by {holder}; wait for that run to end or stop it (a node that "
                          f"crashed holding it keeps it on some NFS mounts until it restarts), or give another {field}")
