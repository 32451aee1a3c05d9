"""SIGTERM, SIGHUP and the processes a run starts.

A stop signal sent to the run's whole process group (`timeout`, `kill -TERM -PGID`, a Slurm
step's signal; SIGHUP from the shell when the terminal closes or an ssh connection drops) must
reach the driver, which finishes the step and saves, and not the helper processes that hold the
step's work: an embedded Ray's GCS, raylet and workers (megarl/ray_cluster/session.py)
and the reward workers with the forkserver and multiprocessing's resource tracker
(megarl/rewards/scorer.py). They are started with STOP_SIGNALS blocked (a blocked signal mask
is inherited across fork and exec, as Ray blocks SIGINT in its processes); a process that must
stop on a plain SIGTERM again (an SGLang server, a reward worker, which pebble stops with one)
unblocks them itself.

Only SIGTERM and SIGHUP are shielded so. The other stops the driver takes (SIGALRM, SIGXCPU, the
real-time signals: megarl/signal_kinds.py) are not blocked in these processes: a blocked signal
stays blocked in every process they start, Ray's workers included, which run user code and
unblock nothing, where it would silently disable a ``signal.alarm`` timeout (common in reward
and answer-checking code) or a sampling profiler's SIGPROF. Such a signal sent to the whole
process group ends Ray's processes as their default has it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP}  # (SIGINT: Ray blocks it itself, reward workers ignore it)


def stop_signals_blocked_in_children() -> AbstractContextManager[None]:
    """STOP_SIGNALS blocked in this thread while it starts processes (and threads, which start
    processes later): they inherit the block. A signal meanwhile is delivered to this process
    when the block ends. Off the main thread: nothing (Python's handlers run there)."""
    return _blocked(STOP_SIGNALS)


def hangup_blocked_in_children() -> AbstractContextManager[None]:
    """SIGHUP alone blocked, for a helper that takes SIGTERM its own way (multiprocessing's
    resource tracker ignores it; started with it blocked too, reward workers were seen to die of a
    group SIGTERM, exit code 255)."""
    return _blocked({signal.SIGHUP})


@contextmanager
def _blocked(signals: set[signal.Signals]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    """In a process started under stop_signals_blocked_in_children that must stop on SIGTERM."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive: it may not be signalled)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int) -> None:
    """In a child, first: SIGKILL when the thread that started it ends (Linux's PR_SET_PDEATHSIG;
    a child whose parent ``parent`` ended before that call exits at once). Nothing off Linux."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: no such call
        return
    if os.getppid() != parent:
        os._exit(1)


_fork_hook: list[bool] = []  # registered once per process; [True] in a child forked by the main thread in scope
_in_scope: list[bool] = []  # [True] while forks_die_with_this_process's block runs
_pass_stops_on: list[bool] = []  # [True]: this process is a driver (forks_pass_stops_on)
_driver_stops: list[tuple[int, ...]] = []  # the signals the driver's handlers take as stops now, innermost last


def forks_pass_stops_on() -> None:
    """In a driver: the children forks_die_with_this_process covers pass its stops on to it."""
    _pass_stops_on[:] = [True]


@contextmanager
def stops_handled(signals: Iterable[int]) -> Iterator[None]:
    """While the block runs, ``signals`` are the driver's stops (megarl/trainer/watchdog.py
    RunControl): the ones a child forked under forks_die_with_this_process passes on."""
    _driver_stops.append(tuple(signals))
    try:
        yield
    finally:
        _driver_stops.pop()


@contextmanager
def forks_die_with_this_process() -> Iterator[None]:
    """While the block runs (megatron-core's save), a child this process forks from its main
    thread (``os.fork``: multiprocessing's fork context, the save's checkpoint writers) gets
    PR_SET_PDEATHSIG: it is killed with this process, whatever ends it, and does not hold the pipes
    that tell the reward pool's forkserver, its workers and multiprocessing's resource tracker
    that the driver is gone. Scoped to the block because the hook is process-wide: it would also
    reach a ``subprocess.Popen(preexec_fn=...)`` from the main thread (Python runs at-fork hooks
    there), such as an SGLang server started to outlive the driver; inside the block such a Popen
    is covered too. Forks from other threads are left alone (the signal fires when the forking
    thread ends, not the process). A stop sent to a child while it is being forked, before its
    after-fork setup ran, is lost: signal it once it has reported that it runs.

    In a driver (forks_pass_stops_on), such a child passes every stop the driver's handlers take
    (stops_handled: SIGTERM, SIGHUP, SIGALRM, the real-time signals, ...) on to this process: it
    carries the driver's command line, so ``pgrep -f`` finds it as well, and the driver's handler
    it inherited would announce a stop in a process that cannot act on it (and, after a first
    stop, abort the child's write). Repeats of one within seconds count as one stop
    (megarl/trainer/watchdog.py), so a signal that reached both is not doubled; but a repeated
    SIGINT stops at once, so the child ignores SIGINT (a Ctrl-C, `pkill -INT -f` reach the
    driver as well)."""
    _register_fork_hook()
    outer = bool(_in_scope)
    _in_scope[:] = [True]
    try:
        yield
    finally:
        if not outer:
            _in_scope.clear()


def _register_fork_hook() -> None:
    import ctypes

    if _fork_hook:
        return
    try:
        prctl = ctypes.CDLL(None).prctl  # looked up here: a forked child of a threaded process loads nothing
    except (OSError, AttributeError):  # not Linux: no such call
        return
    _fork_hook.append(False)

    def before() -> None:
        _fork_hook[0] = bool(_in_scope) and threading.current_thread() is threading.main_thread()

    def after_in_child() -> None:
        if not _fork_hook[0]:
            return
        _fork_hook[0] = False
        parent = os.getppid()
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if parent == 1:  # the parent was gone before the call: nothing would kill this child
            os._exit(1)
        if _pass_stops_on and _driver_stops:
            for signum in _driver_stops[-1]:
                signal.signal(signum, signal.SIG_IGN if signum == signal.SIGINT else lambda s, frame: os.kill(parent, s))

    os.register_at_fork(before=before, after_in_child=after_in_child)
