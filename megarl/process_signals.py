"""SIGTERM and the processes a run starts.

A stop signal sent to the run's whole process group (`timeout`, `kill -TERM -PGID`, a Slurm
step's signal) must reach the driver, which finishes the step and saves, and not the helper
processes that hold the step's work: an embedded Ray's GCS, raylet and workers
(megarl/actors/ray_groups/session.py) and the reward workers (megarl/rewards/scorer.py). They
are started with SIGTERM blocked (a blocked signal mask is inherited across fork and exec, as
Ray blocks SIGINT in its processes); a process that must stop on a plain SIGTERM again (an
SGLang server, a reward worker, which pebble stops with one) unblocks it itself.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_blocked_in_children() -> Iterator[None]:
    """SIGTERM blocked in this thread while it starts processes (and threads, which start
    processes later): they inherit the block. A SIGTERM meanwhile is delivered to this process
    when the block ends. Off the main thread: nothing (Python's handlers run there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_sigterm() -> None:
    """In a process started under sigterm_blocked_in_children that must stop on SIGTERM."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
