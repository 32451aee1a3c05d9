"""multiprocessing's helper processes around the reward pool (the forkserver, the resource tracker):
their output goes to the workers' log, and a resource tracker that died is started again quietly.

The resource tracker is one process per driver that multiprocessing starts at the first semaphore
(the pool's locks, its shared count): it unlinks what a crashed process left. Killed from outside
(``kill -9``, an OOM killer), it is started again at the next semaphore made or released, from
whichever thread that is, with a UserWarning ("process died unexpectedly, relaunching"), and the
new tracker, told to forget semaphores it never heard of, prints a KeyError traceback for each, to
the terminal. The scorer looks for its death itself (:func:`restart_dead_tracker`, at each call and
each wait) and starts it again with its output in the log: the pool goes on, the user sees nothing.

Left out: a tracker killed between the scorer's looks (POOL_CHECK_S) while pebble starts a worker in
its thread: that start relaunches it as multiprocessing does, with the warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

from megarl.rewards.failures import RewardError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def helpers_output_to(log_path: Path | None) -> Iterator[None]:
    """multiprocessing's helpers started meanwhile (the forkserver, the resource tracker; each
    starts once per process) write to ``log_path`` instead of the terminal: what a worker prints
    before its initializer sends its output to the log is the forkserver's stderr, e.g. the
    traceback of a worker started while the pool is torn down (its locks already unlinked:
    SemLock's FileNotFoundError); and the tracker's leaked-semaphore notes at exit."""
    if log_path is None:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def resource_tracker_pids() -> set[int]:
    """This process's resource tracker, when it started one (multiprocessing's internals: on another
    Python without them, none is known)."""
    pid = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return {pid} if isinstance(pid, int) else set()


def tracker_died() -> bool:
    """Whether this process started a resource tracker that is gone now (multiprocessing's own
    probe: a write to its pipe; another Python without these internals: False, as before)."""
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    alive = getattr(tracker, "_check_alive", None)
    # The tracker's own lock, as its users take it: the probe writes to its pipe, and another
    # thread may be registering a semaphore or starting the tracker meanwhile.
    with getattr(tracker, "_lock", None) or contextlib.nullcontext():
        return getattr(tracker, "_fd", None) is not None and callable(alive) and not alive()


def restart_dead_tracker(log_path: Path | None) -> None:
    """Start the resource tracker again, with its output (and multiprocessing's warning) in
    ``log_path``, when it died; RewardError naming it when it cannot start."""
    if not tracker_died():
        return
    try:
        with helpers_output_to(log_path), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resource_tracker.ensure_running()
            said = "; ".join(str(w.message) for w in seen) or "started again"
            note = f"megarl: multiprocessing's resource tracker died (killed from outside?); {said}\n"
            if log_path is not None:
                os.write(2, note.encode())
    except OSError as exc:
        raise RewardError(f"multiprocessing's resource tracker, which the reward workers' pool needs, died and could "
                          f"not be started again ({exc}); see why it was killed (the OOM killer: dmesg)") from exc
    if log_path is None:
        log.warning("%s", note.strip())
