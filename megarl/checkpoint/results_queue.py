"""The queue megatron-core's torch_dist save collects its write results on, from a manager
process that dies with the one that started it.

megatron-core (``dist_checkpointing/strategies/filesystem_async.py``, 0.16 to 0.19) makes that
queue at the first save from a spawn-context ``multiprocessing.Manager()``: a server process
that only a clean exit of its starter shuts down. After a ``kill -9`` of the driver (an
``--in-process`` run saves there) it would stay, re-parented to pid 1, and so would
multiprocessing's resource tracker, whose pipe the server holds. The same queue from a
manager whose server has PR_SET_PDEATHSIG dies with its starter, and the resource tracker then
reads the end of its pipe and exits. The writers the save forks (fork context, from the main
thread) die with their starter as well (megarl/checkpoint/dist_save.py runs the save under
process_signals.forks_die_with_this_process): a writer caught mid-save would otherwise keep the
reward pool's forkserver, its workers and the resource tracker alive through the pipes it holds.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.managers import SyncManager
from typing import Any

from megarl.process_signals import die_with_parent

_manager: SyncManager | None = None  # kept for the process's life: the queue is megatron's global


def install_results_queue() -> None:
    """Give megatron-core's save its results queue from a manager that dies with this process
    (before the first save; nothing when megatron made one already, has no such global, or this
    is not the main thread)."""
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if threading.current_thread() is not threading.main_thread():  # PDEATHSIG would fire when this thread ends
        return
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = results_queue()


def results_queue() -> Any:
    """A queue served by a spawn-context manager process that dies with this process."""
    global _manager
    if _manager is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _manager = manager
    return _manager.Queue()
