"""Where a supervised driver's stop signal came from: the user (through the megarl command, whose
supervisor passes every stop on: megarl/driver_supervisor.py), its own process group, or its pid.

A driver runs in a process group of its own, and user code runs in it (a generate function, a
tool, an interaction, a dataset class): ``os.killpg(os.getpgrp(), SIGTERM)`` there, meant for the
processes the code started, reaches the driver as a stop that no handler can tell from the user's
(Python gives a handler no sender). Two witnesses tell them apart:

- the supervisor writes each stop's number on a pipe (``announce``) just before it passes it on,
  so the announcement is there by the time the driver's handler asks (:func:`passed_on`);
- a sentinel, a small process the supervisor starts in the driver's process group, writes each
  stop it receives on a second pipe: only a signal to the whole group reaches it
  (:func:`group_signalled`).

A stop that is neither announced nor seen by the sentinel was sent to the driver's pid (`kill PID`),
an ordinary stop. One that is not announced but reached the whole group came from inside (or from
whoever signalled the driver's group: Slurm signals every process of a job, the supervisor too,
whose announcement follows within moments: megarl/trainer/watchdog.py waits for it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable

ANNOUNCE_FD_ENV = "MEGARL_STOPS_ANNOUNCED_FD"  # the driver's end of the announcements
GROUP_FD_ENV = "MEGARL_STOPS_GROUP_FD"  # the driver's end of what the sentinel saw
USER_CODE_ENV = "MEGARL_DRIVER_USER_CODE"  # the user code the driver runs, as the supervisor names it

# The sentinel: records each stop that reaches the driver's process group and goes on (the
# supervisor kills it when the driver has ended; it dies with the supervisor: PR_SET_PDEATHSIG).
_SENTINEL = """# megarl: the stop sentinel of a driver's process group (megarl/stop_origin.py)
import os, signal, sys, time
fd = int(sys.argv[1])
def seen(signum, frame):
    try:
        os.write(fd, bytes([signum]))
    except OSError:
        os._exit(0)
for s in sys.argv[2:]:
    signal.signal(int(s), seen)
while True:
    time.sleep(3600)
"""


class StopWitnesses:
    """The supervisor's side: the two pipes, the announcements and the sentinel."""

    def __init__(self, user_code: str | None) -> None:
        self.user_code = user_code
        self._announced_read, self._announce = os.pipe()
        self._seen_read, self._seen_write = os.pipe()
        os.set_blocking(self._announce, False)  # a driver that never reads them must not block a handler
        os.set_blocking(self._seen_write, False)
        self._sentinel: subprocess.Popen[bytes] | None = None

    def driver_env(self) -> dict[str, str]:
        return {ANNOUNCE_FD_ENV: str(self._announced_read), GROUP_FD_ENV: str(self._seen_read),
                **({USER_CODE_ENV: self.user_code} if self.user_code else {})}  # fmt: skip

    def driver_fds(self) -> tuple[int, int]:
        return self._announced_read, self._seen_read

    def driver_started(self, driver_pid: int, stops: Iterable[int], preexec_fn: Callable[[], object]) -> None:
        """Start the sentinel in the driver's process group (``stops``: what it records) and let go of
        the driver's ends. Without a sentinel (it could not start) every unannounced stop is a `kill PID`."""
        try:
            self._sentinel = subprocess.Popen(
                [sys.executable, "-S", "-c", _SENTINEL, str(self._seen_write), *map(str, stops)], pass_fds=(self._seen_write,),
                process_group=driver_pid, preexec_fn=preexec_fn, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})  # fmt: skip
        except OSError:  # (a driver already gone: no group to join)
            self._sentinel = None
        for fd in (self._announced_read, self._seen_read, self._seen_write):
            os.close(fd)

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
        os.close(self._announce)


_fds: dict[str, int] = {}
_read: dict[str, list[int]] = {"announced": [], "group": []}  # read from the pipes, not yet matched
_user_code: str | None = None


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


def passed_on(signum: int) -> bool | None:
    """Whether the supervisor passed this stop on (None: no supervisor). One announcement answers
    one signal (two sends that reached the driver as one, standard signals not queueing, leave one
    over: only a run's first stop is asked about)."""
    return _matched("announced", signum)


def group_signalled(signum: int) -> bool:
    """Whether ``signum`` reached the driver's whole process group (the sentinel saw it)."""
    return bool(_matched("group", signum))


def user_code_in_driver() -> str | None:
    """The user code this supervised driver runs, as its supervisor names it (None: none known)."""
    return _user_code


def _matched(name: str, signum: int) -> bool | None:
    fd = _fds.get(name)
    if fd is None:
        return None
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        _read[name].extend(chunk)
    if signum in _read[name]:
        _read[name].remove(signum)
        return True
    return False
