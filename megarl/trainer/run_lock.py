"""One writer per output: a second `megarl launch` (a Slurm requeue while the old job is
still alive, a command started twice) on the same ``trainer.output_dir`` would resume from the
first one's checkpoints while it trains, save over its steps and cut its metrics.jsonl; a second
`megarl generate` into the same --out would continue the first one's partial folder while it
writes there, and two converts or evaluates would swap their outputs over each other.

The lock is a POSIX record lock (``lockf``) on ``<output_dir>/.megarl.lock``, held by the
command's process (a supervised driver's supervisor, below) for the whole run: the kernel releases
it when the process ends however it ends (no stale lock after a SIGKILL), processes the holder
forks (a reward pool) do not inherit it, unlike ``flock``'s, and NFS honours it. Being the
process's own, it does not stop a second hold from the same process and is dropped when the
process closes any descriptor of the file: so a second hold in one process is refused here (a
registry of held paths), and nothing else opens the file. The file names its holder for the
refusal; it stays in place, but in a folder made for it that nothing else was written into (a run
refused, or failed, at once): the folder goes, while the lock is held, and a process that opened
the file meanwhile finds once it holds it that the path names another file (or none) and starts
again. Where the filesystem has no record locks (some Lustre and NFS mounts), the run goes on
unlocked, with a warning.

A command's --out (output_lock: `megarl generate`, `convert`, `evaluate`) is a file or folder
that is replaced whole, so its lock is a file of its own beside it, ``.<name>.megarl.lock``,
removed when the command ends (a killed command's stays, harmless: the next one takes it). A
process that opened that file just before its holder removed it sees, once it holds the lock,
that the path names another file (or none) and starts again, so two processes never hold two
files of one output. A command checks that lock (check_output_free) before its slow start, so
that a second one is refused in seconds, and holds it once it writes.

A supervised command (megarl/commands/supervision.py) takes its driver's lock in the command's
process before the driver starts and keeps it until the driver and what it left have ended: a
second command is refused in its first second, not after the first one's driver has imported for
seconds. The driver, whose record locks are its own, is told in its environment which file its
supervisor holds for it (device and inode) and writes under that hold.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megarl.disk_full import FULL, DiskFullError, reason_of
from megarl.driver_supervisor import command_pid, supervisor_holds

LOCK_FILE = ".megarl.lock"
log = logging.getLogger(__name__)


class OutputDirInUse(RuntimeError):
    """Another live process runs in this output directory, or writes this output."""


_HELD: set[Path] = set()  # the lock files this process holds
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # a filesystem without record locks


@contextmanager
def output_dir_lock(output_dir: str | Path, field: str = "trainer.output_dir") -> Iterator[str | None]:
    """Hold ``output_dir`` for this process; refuse (OutputDirInUse naming the holder) when
    another process, or this one, holds it. ``field`` names the config key in the message. Yields
    the hold's claim for a supervised driver (see _held)."""
    path = Path(output_dir).absolute()
    if path.exists() and not path.is_dir():
        raise OutputDirInUse(f"{field} {output_dir} is a file; give a folder (the run writes its checkpoints, logs and "
                             "metrics in it)")  # fmt: skip
    made = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    path.mkdir(parents=True, exist_ok=True)
    # a run refused (or a supervised driver that failed) before it wrote anything leaves no folder
    with _held((path / LOCK_FILE).resolve(), field, output_dir, "run", remove=False,
               at_end=functools.partial(_remove_if_only_the_lock, path, made)) as claim:  # fmt: skip
        yield claim


def _remove_if_only_the_lock(path: Path, made: list[Path]) -> None:
    """The folders this process made for the lock (deepest first), when nothing but the lock file
    was put in them; done while the lock is still held (another process that opened the file
    meanwhile finds, once it holds it, that the path names none, and starts again)."""
    try:
        if not made or set(os.listdir(path)) != {LOCK_FILE}:
            return
        (path / LOCK_FILE).unlink()
        for folder in made:
            folder.rmdir()
    except OSError:  # something else is in one of them: kept
        return


@contextmanager
def output_lock(output: str | Path, flag: str = "--out") -> Iterator[str | None]:
    """Hold the file or folder ``output`` that a command writes (its lock file beside it, removed
    at the end); refuse (OutputDirInUse naming the holder's pid) when another process, or this
    one, writes it. Folders made for the lock file are removed at the end when still empty (a
    command refused later leaves none). Yields the hold's claim for a supervised driver (see _held)."""
    path = Path(output).absolute()
    made = [p for p in [path.parent, *path.parent.parents] if not os.path.lexists(p)]
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _output_lock_file(path)
    try:
        with _held(lock, flag, path, "command", remove=True) as claim:  # (named absolute: the command's and its driver's words agree)
            yield claim
    finally:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # the output (or anything else) is in it
                break


def _output_lock_file(path: Path) -> Path:
    """The lock file of the output ``path`` (absolute): beside it, in its real folder."""
    return path.parent.resolve() / f".{path.name}.megarl.lock"


def check_output_free(output: str | Path, flag: str = "--out") -> None:
    """Refuse now (OutputDirInUse naming the holder) when another process holds the lock of
    ``output`` (output_lock's; this process's own hold, or its supervisor's for it, is no
    refusal): the check a command makes before its slow start (the config, the model's checks, a
    driver's imports), so that a second one into the same output is refused in seconds. Holds
    nothing and creates nothing: no lock file, no holder."""
    path = Path(output).absolute()
    _probe(_output_lock_file(path), functools.partial(_in_use, flag, path, what="command"))  # named as the hold names it


def _probe(lock: Path, refusal: Callable[[str], OutputDirInUse]) -> None:
    """``refusal(holder)`` raised when the record lock of the file ``lock`` is held."""
    if lock in _HELD or _held_by_supervisor(lock):  # free for this process (a probe's close would drop its own hold)
        return
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # none there (or a folder that is not): the hold itself decides
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a holder has its exclusive lock
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise refusal(_holder(fd)) from None
        # a filesystem without record locks: the hold says so
    finally:
        os.close(fd)


@contextmanager
def _held(lock: Path, field: str, output: str | Path, what: str, *, remove: bool,
          at_end: Callable[[], None] | None = None) -> Iterator[str | None]:  # fmt: skip
    """Hold the record lock on the file ``lock`` for ``field``'s ``output`` (a ``what``: run or
    command, in the messages); ``remove``: the file goes when the hold ends; ``at_end``: run then,
    while still held. Yields the claim a supervisor passes its driver (SUPERVISOR_HOLDS_ENV): the
    file's device and inode, by which the driver knows the hold is its supervisor's (None where
    this process writes under its own supervisor's hold)."""
    refusal = functools.partial(_in_use, field, output, what=what)
    if lock in _HELD:
        raise refusal("this process")
    if _held_by_supervisor(lock):  # for this driver's whole life: it writes under that hold
        _HELD.add(lock)
        try:
            yield None
        finally:
            _HELD.discard(lock)
        return
    while True:
        lock.parent.mkdir(parents=True, exist_ok=True)  # (gone if its holder removed the folder as we opened)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)  # umask decides: a group-writable folder stays shared
        try:
            locked = _lock(fd, refusal, f"{field} {output}: the filesystem has no file locks (%s); nothing stops a second {what} there")
        except BaseException:
            os.close(fd)
            raise
        if not locked or _names(lock, fd):
            break
        os.close(fd)  # its holder removed it as we opened it: lock the file the path names now
    try:
        try:
            if locked:
                _write_holder(fd, lock, f"{field} {output}", remove=remove)
        except BaseException:  # (a full disk) the hold ends before it began: what it made goes as at its end
            if at_end is not None:
                at_end()
            raise
        _HELD.add(lock)
        stat = os.fstat(fd)
        try:
            yield f"{stat.st_dev}:{stat.st_ino}"
        finally:
            _HELD.discard(lock)
            if remove:
                lock.unlink(missing_ok=True)  # while still held: a process waiting on it starts again
            if at_end is not None:
                at_end()
    finally:
        os.close(fd)  # releases the lock


def _write_holder(fd: int, lock: Path, of: str, *, remove: bool) -> None:
    """Who holds the lock, in its file: the pid the user started (megarl launch's, not its
    driver's), the one to stop. A full disk here is the command's first write: one line naming the
    lock file, and the file made for it goes (``remove``)."""
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {command_pid()} on {socket.gethostname()} (since {since})".encode(), 0)
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        if remove:
            lock.unlink(missing_ok=True)
        raise DiskFullError(lock, f"the lock file of {of}", reason_of(exc), kept="nothing: the command had written nothing yet") from None


def _lock(fd: int, refusal: Callable[[str], OutputDirInUse], unlocked: str) -> bool:
    """Lock ``fd``: True when held, False on a filesystem without record locks (the warning
    ``unlocked``); a lock held elsewhere is refused (``refusal``, given the holder)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            log.warning(unlocked, exc.strerror)
            return False
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise refusal(_holder(fd)) from None
        raise
    return True


def _held_by_supervisor(lock: Path) -> bool:
    """Whether this process is a supervised driver whose supervisor holds the file ``lock`` for it
    (the claim it was given names that file's device and inode)."""
    claims = supervisor_holds()
    if not claims:
        return False
    try:
        stat = os.stat(lock)
    except OSError:
        return False
    return f"{stat.st_dev}:{stat.st_ino}" in claims


def _holder(fd: int) -> str:
    """What the lock file ``fd`` says of its holder (the pid, host and time _held wrote)."""
    return os.read(fd, 512).decode(errors="replace").strip() or "another process"


def _names(lock: Path, fd: int) -> bool:
    """Whether the path ``lock`` still names the open file ``fd``."""
    try:
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _in_use(field: str, output: str | Path, holder: str, *, what: str) -> OutputDirInUse:
    return OutputDirInUse(f"{field} {output} is in use by {holder}; wait for that {what} to end or stop it (a node that "
                          f"crashed holding it keeps it on some NFS mounts until it restarts), or give another {field}")
