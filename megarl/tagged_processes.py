"""The processes of one supervised driver (or of one block of a command without a supervisor:
:func:`ending_what_it_starts`), found after it ended by a tag in their environment.

The supervisor (megarl/driver_supervisor.py) starts the driver with ``MEGARL_DRIVER_TAG=<unique>``
in its environment; every process the driver starts inherits it, and the processes those start
too: an embedded Ray's GCS, raylet, agents and workers (a raylet starts its workers with its own
environment), reward workers, engines. A process re-parented when its parent died keeps it: Ray's
workers whose raylet was killed (they take 20-40 s to notice), which neither the driver's teardown
nor the session's reaper can find any more, since both look down the driver's process tree.
Another run's processes carry another tag (or none: a cluster's raylet and workers, attached to
with ``--address``, never came from this driver), so the sweep touches this run's alone.

megarl's code sandbox (megarl/rewards/code_sandbox.py) starts each program with a fresh
environment but passes the tag on, so a program that sleeps past its test is found too.

Left out: a process that replaced its environment on exec without keeping the tag (user code
that starts processes with an environment of its own), and systems without /proc (nothing is
found there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator

DRIVER_TAG_ENV = "MEGARL_DRIVER_TAG"
SWEEP_ROUNDS = 20  # a process that starts another while the sweep runs is found on the next round
SWEEP_PAUSE_S = 0.05
TERM_GRACE_S = 1.0  # how long the tagged processes have to end on SIGTERM before the SIGKILL
EXIT_WAIT_S = 10.0  # how long the signalled processes have to finish exiting
log = logging.getLogger(__name__)


def new_tag() -> str:
    """A tag no other driver on this machine has: this supervisor's pid and the time."""
    return f"{os.getpid()}-{time.time_ns()}"


def tagged(tag: str) -> list[int]:
    """The pids of the running processes whose environment carries ``tag`` (this one excepted)."""
    entry = f"{DRIVER_TAG_ENV}={tag}".encode()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if name.isdigit() and int(name) != os.getpid() and _carries(int(name), entry):
            found.append(int(name))
    return found


def _carries(pid: int, entry: bytes) -> bool:
    """Whether process ``pid``'s initial environment holds ``entry`` (a zombie's reads empty;
    another user's process cannot be read: neither is ours to end)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def end_tagged(tag: str, spare: Collection[int] = ()) -> int:
    """End every process carrying ``tag`` but the ``spare`` pids: SIGTERM first, and up to
    TERM_GRACE_S for them to go (wandb's service flushes), then SIGKILL, round after round until
    none is left (a few rounds at most); the number ended, once each has exited (up to
    EXIT_WAIT_S). A process that blocks SIGTERM (Ray's processes and the reward pool's forkserver,
    shielded from a group's SIGTERM) would never act on it: SIGKILL at once. Each is held by a
    pidfd from before its tag is read until it has exited, so a pid that a new process took
    meanwhile is never signalled nor waited for."""

    def left() -> list[int]:
        return [pid for pid in tagged(tag) if pid not in spare]

    held: dict[int, int] = {}  # pid -> its pidfd, for each process signalled
    termed: set[int] = set()
    killed: set[int] = set()
    try:
        for pid in left():
            if _blocks_sigterm(pid):
                killed.update([pid] if _signal_if_tagged(pid, tag, signal.SIGKILL, held) else [])
            elif _signal_if_tagged(pid, tag, signal.SIGTERM, held):
                termed.add(pid)
        deadline = time.monotonic() + TERM_GRACE_S
        while termed and time.monotonic() < deadline and left():
            time.sleep(SWEEP_PAUSE_S)
        for _ in range(SWEEP_ROUNDS):
            pids = left()
            if not pids:
                break
            killed.update(pid for pid in pids if _signal_if_tagged(pid, tag, signal.SIGKILL, held))
            time.sleep(SWEEP_PAUSE_S)
        _wait_exited(held, time.monotonic() + EXIT_WAIT_S)
    finally:
        for fd in held.values():
            os.close(fd)
    return len(termed | killed)


def _wait_exited(held: dict[int, int], deadline: float) -> None:
    """Until each process of ``held`` (pid -> pidfd) has exited (a zombie at least) or ``deadline``.
    A killed process's environment reads empty as soon as its memory is released, before it has
    closed its files: a forkserver this process started was still accepting a connection then,
    and a pool started next in this process (a second evaluate) asked it for a worker and read EOF."""
    waiting = select.poll()
    for fd in held.values():
        waiting.register(fd, select.POLLIN)  # readable once the process has exited
    running = dict(held)
    while running and (left_s := deadline - time.monotonic()) > 0:
        for fd, _ in waiting.poll(left_s * 1000):
            waiting.unregister(fd)
            running = {pid: f for pid, f in running.items() if f != fd}
    if running:  # uninterruptible sleep (a hung NFS mount, a device's teardown): not waited for longer
        log.warning("processes %s had not exited %.0f s after their stop signal; going on without them",
                    sorted(running), EXIT_WAIT_S)  # fmt: skip


def _blocks_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has SIGTERM blocked (its /proc status's SigBlk mask; unreadable:
    False, it gets its SIGTERM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((line.split()[1] for line in f if line.startswith("SigBlk:")), "0")
        return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False


@contextlib.contextmanager
def ending_what_it_starts(spare: Callable[[], Collection[int]] = set) -> Iterator[None]:
    """For a command that runs without a supervisor (``megarl evaluate``): the processes started
    inside the block by an exec (a forkserver, a server, a subprocess), and every process those
    fork or start (a reward function's own children, which outlive their worker re-parented),
    are ended at the block's end if still there, but for ``spare()`` (asked then: multiprocessing's
    resource tracker, which must outlive the block to unlink the process's semaphores at its
    exit). They carry the tag this process's environment holds while the block runs. Not found:
    a child this process forks itself without an exec (its environment as this process's was at
    its own start), what forks from a process started before the block (a forkserver this process
    already had), a process that replaced its environment. The environment is the process's, so
    the block runs in the main thread, never nested."""
    assert threading.current_thread() is threading.main_thread(), "ending_what_it_starts: main thread only"
    tag, before = new_tag(), os.environ.get(DRIVER_TAG_ENV)
    os.environ[DRIVER_TAG_ENV] = tag
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DRIVER_TAG_ENV, None)
        else:
            os.environ[DRIVER_TAG_ENV] = before
        end_tagged(tag, spare=spare())


def _signal_if_tagged(pid: int, tag: str, signum: int, held: dict[int, int]) -> bool:
    """Send ``signum`` to ``pid`` if it carries ``tag``; its pidfd then stays in ``held`` (the one
    it already has there is used)."""
    entry = f"{DRIVER_TAG_ENV}={tag}".encode()
    fd = held.get(pid)
    if fd is None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already (or a kernel without pidfds: the plain kill below)
            fd = None
    sent = False
    try:
        if not _carries(pid, entry):
            return False
        if fd is None:
            os.kill(pid, signum)
        else:
            signal.pidfd_send_signal(fd, signum)
        sent = True
        return True
    except OSError:  # ended meanwhile
        return False
    finally:
        if fd is not None and pid not in held:
            if sent:
                held[pid] = fd  # (closed by end_tagged, after the wait)
            else:
                os.close(fd)
