"""Where a supervised driver's stop signal came from: the user (through the megarl command, whose
supervisor passes every stop on: megarl/driver_supervisor.py), or the driver itself.

A driver runs in a process group of its own, and user code runs in it (a generate function, a
tool, an interaction, a dataset class): ``os.killpg(os.getpgrp(), SIGTERM)`` there, meant for the
processes the code started, reaches the driver as a stop that its handler cannot tell from the
user's (Python gives a handler no sender). Two witnesses tell them apart:

- the supervisor writes each stop's number on a pipe (``announce``) just before it passes it on,
  so the announcement is there by the time the driver's handler asks (:func:`passed_on`): such a
  stop is the user's, acted on at once;
- a sentinel, a small process the supervisor starts in the driver's process group, takes every
  stop that reaches the whole group with ``sigwaitinfo`` (which gives the sender's pid) and writes
  the signal and whether its sender was the driver or one of its descendants (:func:`group_sender`).
  A sender that has already exited and been reaped (``subprocess.run(["kill", "-TERM", "0"])``
  ends within microseconds) has no ancestry left to follow: the driver notes the pid of each
  process it starts itself with ``subprocess`` (asyncio's subprocesses and ``os.popen`` use it too)
  and when it was reaped, and such a sender among them, reaped after the signal could have been
  sent, is the driver's (an older one's pid may since have been given to another process; asyncio
  reaps its own children, so theirs count whenever they ended). One
  that process started in turn, or one started otherwise (``os.system``, ``os.fork``,
  ``multiprocessing``), that ended first cannot be traced.

Only that positive evidence makes a stop the driver's own doing (megarl/trainer/watchdog.py); a stop
sent to the group from outside (Slurm signals every process of a job; `kill -- -PGID`), or to the
driver's pid alone, or one the sentinel did not record in time, is the user's stop as any other.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

ANNOUNCE_FD_ENV = "MEGARL_STOPS_ANNOUNCED_FD"  # the driver's end of the announcements
GROUP_FD_ENV = "MEGARL_STOPS_GROUP_FD"  # the driver's end of what the sentinel saw
USER_CODE_ENV = "MEGARL_DRIVER_USER_CODE"  # the user code the driver runs, as the supervisor names it
_RECORD = struct.Struct("=iiBd")  # the sentinel's record: signal, sender pid, where the sender is (below), when it looked
INSIDE, GONE = 1, 2  # the sender: the driver or its descendant; exited before it was looked at (0: outside the driver's)
REAPED_WITHIN_S = 5.0  # a gone sender the driver started was reaped at most this long before the sentinel looked

# The sentinel: blocks the stops (so they wait for sigwaitinfo, which names the sender) and records
# each with whether its sender is the driver, the group's leader, or a descendant of it. The
# supervisor kills it when the driver has ended; it dies with the supervisor (PR_SET_PDEATHSIG).
_SENTINEL = """# megarl: the stop sentinel of a driver's process group (megarl/stop_origin.py)
import errno, os, signal, struct, sys, time
fd, stops = int(sys.argv[1]), {int(s) for s in sys.argv[2:]}
signal.pthread_sigmask(signal.SIG_BLOCK, stops)
driver = os.getpgrp()

def where(pid):  # 0: outside the driver's tree, 1: the driver or its descendant, 2: gone before looked at
    for step in range(256):
        if pid == driver:
            return 1
        if pid <= 1:
            return 0
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (FileNotFoundError, ProcessLookupError):  # (ESRCH: reaped while its file was read)
            return 2 if step == 0 else 0  # (an ancestor gone: its orphans were re-parented, not the driver's)
        except (OSError, ValueError, IndexError):  # (not readable: /proc mounted hidepid)
            return 0
    return 0

while True:
    info = signal.sigwaitinfo(stops)
    try:
        os.write(fd, struct.pack("=iiBd", info.si_signo, info.si_pid, where(info.si_pid), time.monotonic()))
    except BlockingIOError:
        pass  # a driver that reads none: nothing to tell it
    except OSError as exc:
        if exc.errno in (errno.EPIPE, errno.EBADF):
            os._exit(0)
"""


class StopWitnesses:
    """The supervisor's side: the two pipes, the announcements and the sentinel."""

    def __init__(self, user_code: str | None) -> None:
        self.user_code = user_code
        self._announced_read, self._announce = os.pipe()
        self._seen_read, self._seen_write = os.pipe()
        os.set_blocking(self._announce, False)  # a driver that never reads them must not block a handler
        os.set_blocking(self._seen_write, False)
        self._open = [self._announced_read, self._announce, self._seen_read, self._seen_write]
        self._sentinel: subprocess.Popen[bytes] | None = None

    def driver_env(self) -> dict[str, str]:
        return {ANNOUNCE_FD_ENV: str(self._announced_read), GROUP_FD_ENV: str(self._seen_read),
                **({USER_CODE_ENV: self.user_code} if self.user_code else {})}  # fmt: skip

    def driver_fds(self) -> tuple[int, int]:
        return self._announced_read, self._seen_read

    def driver_started(self, driver_pid: int, stops: Iterable[int], preexec_fn: Callable[[], object]) -> None:
        """Start the sentinel in the driver's process group (``stops``: what it records) and let go of
        the driver's ends. Without a sentinel (it could not start) every stop is the user's."""
        try:
            self._sentinel = subprocess.Popen(
                [sys.executable, "-S", "-c", _SENTINEL, str(self._seen_write), *map(str, stops)], pass_fds=(self._seen_write,),
                process_group=driver_pid, preexec_fn=preexec_fn, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        except (OSError, subprocess.SubprocessError):  # (a driver already gone: no group to join)
            self._sentinel = None
        self._close(self._announced_read, self._seen_read, self._seen_write)

    def announce(self, signum: int) -> None:
        """Before passing ``signum`` on to the driver."""
        try:
            os.write(self._announce, bytes([signum]))
        except OSError:  # a driver that closed its end (it is ending): the signal still goes
            pass

    def close(self) -> None:
        if self._sentinel is not None:
            self._sentinel.kill()
            self._sentinel.wait()
        self._close(*self._open)

    def _close(self, *fds: int) -> None:
        for fd in fds:
            if fd in self._open:
                self._open.remove(fd)
                os.close(fd)


_fds: dict[str, int] = {}
_announced: list[int] = []  # read from the supervisor's pipe, not yet matched with a signal
_recorded: list[tuple[int, int, int, float]] = []  # the sentinel's records not yet asked for
_partial = bytearray()  # a record the last read cut
_records_lock = threading.Lock()  # (each held stop's judge is a thread of its own)
_user_code: str | None = None
_NOTED = 4096  # subprocesses the driver keeps a note of (the latest)
_spawned: deque[int] = deque(maxlen=_NOTED)  # the pids of the driver's latest subprocesses
_reaped: dict[int, float] = {}  # of those, when each was reaped (time.monotonic()), as far as known


def take_witnesses() -> None:
    """At the start of a supervised driver: the two pipes become this process's (the environment
    variables are forgotten, so processes this one starts do not hold them)."""
    global _user_code
    _user_code = os.environ.pop(USER_CODE_ENV, None) or None
    for name, env in (("announced", ANNOUNCE_FD_ENV), ("group", GROUP_FD_ENV)):
        fd = os.environ.pop(env, None)
        if fd is not None and fd.isdigit():
            _fds[name] = int(fd)
            os.set_inheritable(_fds[name], False)
            os.set_blocking(_fds[name], False)
    if _fds:
        _note_subprocesses()


def _note_subprocesses() -> None:
    """From now on every ``subprocess.Popen`` of this process notes its child's pid in ``_spawned``,
    and when it was reaped in ``_reaped``: the one record of a sender that exited before the
    sentinel could follow its ancestry. (Wrappers of Popen's constructor and of the method that
    records a child's exit status, which every wait, poll and clean-up goes through: Python offers
    no hook on process creation, and ``os.register_at_fork`` does not run for the fork that
    ``subprocess`` does in C.)"""
    popen: Any = subprocess.Popen
    if getattr(popen.__init__, "_megarl_notes", False):
        return
    start, ended = popen.__init__, getattr(popen, "_handle_exitstatus", None)

    @functools.wraps(start)
    def started(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)
        _reaped.pop(self.pid, None)  # (a pid given again)
        _spawned.append(self.pid)

    started._megarl_notes = True  # type: ignore[attr-defined]
    popen.__init__ = started
    if ended is not None:  # (a private method: a Python without it leaves reap times unknown)

        @functools.wraps(ended)
        def reaped(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
            ended(self, *args, **kwargs)
            try:
                _reaped[self.pid] = time.monotonic()
                while len(_reaped) > _NOTED:
                    _reaped.pop(next(iter(_reaped)), None)
            except (RuntimeError, StopIteration, TypeError):  # (two threads trimming at once; globals gone at exit)
                pass

        popen._handle_exitstatus = reaped


def passed_on(signum: int) -> bool | None:
    """Whether the supervisor passed this stop on (None: no supervisor). One announcement answers
    one signal (two sends that reached the driver as one, standard signals not queueing, leave one
    over: only a run's first stop is asked about)."""
    if "announced" not in _fds:
        return None
    _take_announcements()
    if signum in _announced:
        _announced.remove(signum)
        return True
    return False


def announced_unclaimed() -> list[int]:
    """The stops the supervisor announced that no signal delivered to a handler of megarl's has
    claimed yet (passed_on): a stop user code kept from megarl (its own handler, SIG_IGN)."""
    _take_announcements()
    return list(_announced)


def _take_announcements() -> None:
    """The supervisor's announcements written since the last look, into ``_announced``."""
    if "announced" in _fds:
        _announced.extend(drain(_fds["announced"]))


def group_sender(signum: int) -> tuple[int, bool] | None:
    """The sentinel's record of ``signum`` reaching the driver's whole process group: (the sender's
    pid, whether it is the driver or one of its descendants, or a subprocess of the driver's that
    had exited when the sentinel looked); None: none (yet)."""
    if "group" not in _fds:
        return None
    with _records_lock:
        _partial.extend(drain(_fds["group"]))
        whole = len(_partial) - len(_partial) % _RECORD.size
        _recorded.extend(_RECORD.iter_unpack(bytes(_partial[:whole])))
        del _partial[:whole]
        for record in _recorded:
            if record[0] == signum:
                _recorded.remove(record)
                _, pid, where, looked_at = record
                return pid, where == INSIDE or (where == GONE and _started_and_just_reaped(pid, looked_at))
    return None


def _started_and_just_reaped(pid: int, looked_at: float) -> bool:
    """Whether ``pid`` is a subprocess of this driver's, reaped (if known) no longer than
    REAPED_WITHIN_S before the sentinel looked at ``looked_at``: not a pid of one long gone, given since
    to a process outside."""
    if pid not in _spawned:
        return False
    reaped = _reaped.get(pid)
    return reaped is None or reaped >= looked_at - REAPED_WITHIN_S


def user_code_in_driver() -> str | None:
    """The user code this supervised driver runs, as its supervisor names it (None: none known)."""
    return _user_code


def drain(fd: int) -> bytes:
    """What was written on the non-blocking pipe ``fd`` since the last read (nothing once it is closed)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        except OSError as exc:  # (closed: nothing more)
            if exc.errno == errno.EBADF:
                break
            raise
        if not chunk:
            break
        data += chunk
    return data
