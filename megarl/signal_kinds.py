"""What each signal from outside means to a megarl command: one table for the driver's handlers
(megarl/trainer/watchdog.py ``RunControl``) and its supervisor's (megarl/driver_supervisor.py).

- ``STOPS``: SIGINT (Ctrl-C), SIGTERM (Slurm's preemption), SIGHUP (a closed terminal) and SIGQUIT
  (Ctrl-\\, at once): the stops with a meaning of their own, told apart where they are handled.
- ``OTHER_STOPS``: every other signal whose default action would end the process without a word
  (SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU, SIGPWR, SIGSTKFLT, SIGIO, the real-time signals): a stop
  like SIGTERM. Computed from the signals this platform has, so none is missed: all of them less
  the ones above, the ones below, those whose default ends nothing (SIGCHLD, SIGCONT, SIGURG,
  SIGWINCH; SIGTSTP, SIGTTIN and SIGTTOU only pause), those Python ignores (SIGPIPE, SIGXFSZ: a
  failed write raises instead), the faults a process raises on itself (SIGSEGV, SIGBUS, SIGFPE,
  SIGILL, SIGTRAP, SIGSYS, SIGABRT: faulthandler's and Ray's crash reports), and SIGKILL / SIGSTOP
  (no handler can be set).
- ``STACKS_SIGNALS``: SIGUSR1 / SIGUSR2, "write your stacks" (megarl/cli.py), never a stop.
- ``HANG_SIGNAL``: the watchdog's interrupt of the driver's main thread (SIGRTMIN+4). Sent from
  outside (no hang found) it is a stop like the OTHER_STOPS: ``OUTSIDE_STOPS`` is both.

Every stop ends the command with exit code 128 + the signal's number, as a shell reports a
process that signal killed.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

STOPS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
STACKS_SIGNALS: tuple[int, ...] = (signal.SIGUSR1, signal.SIGUSR2)  # (SIGUSR2 as well: schedulers send either)
# A real-time signal nobody sends from outside, past the ones glibc keeps for itself.
HANG_SIGNAL: int = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
_FAULTS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT", "SIGEMT")  # a process's own faults
_NO_STOP = ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGINFO", "SIGTSTP", "SIGTTIN", "SIGTTOU",  # default: nothing ends
            "SIGPIPE", "SIGXFSZ",  # Python ignores them
            *_FAULTS,
            "SIGKILL", "SIGSTOP")  # no handler  # fmt: skip
# The signals a process's crash ends it with (a fault in C code, abort()): the others came from a kill.
FAULTS: tuple[int, ...] = tuple(int(getattr(signal, name)) for name in _FAULTS if hasattr(signal, name))


def _other_stops() -> tuple[int, ...]:
    known = {getattr(signal, name) for name in _NO_STOP if hasattr(signal, name)}
    known |= {*STOPS, *STACKS_SIGNALS, HANG_SIGNAL}
    return tuple(sorted(int(s) for s in signal.valid_signals() if s not in known))


OTHER_STOPS: tuple[int, ...] = _other_stops()
# What a stop from outside may be, besides STOPS: every real-time signal, the watchdog's too (where
# it has one of its own: without SIGRTMIN it is SIGUSR2, the stacks request).
OUTSIDE_STOPS: tuple[int, ...] = OTHER_STOPS if HANG_SIGNAL in STACKS_SIGNALS else tuple(sorted((*OTHER_STOPS, HANG_SIGNAL)))


def exit_code(signum: int) -> int:
    """The exit code of a command stopped by ``signum``."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """``signum``'s name as `kill -l` prints it: SIGALRM, SIGRTMIN+2, SIGRTMAX-3 (``signal N`` for
    one the platform does not name)."""
    low, high = getattr(signal, "SIGRTMIN", 0), getattr(signal, "SIGRTMAX", -1)
    if low < signum < high:
        return f"SIGRTMIN+{signum - low}" if signum - low <= (high - low) // 2 else f"SIGRTMAX-{high - signum}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def unclaimed(signals: Iterable[int], owner: type | None = None) -> list[int]:
    """Those of ``signals`` at their default action here, or handled by a method of an ``owner``
    instance (an outer one of the same kind, whose handler comes back when the inner one ends): a
    handler a library set in Python and an ignore the parent process chose (`nohup`, a scheduler)
    are left alone. Only Python's view is read (signal.getsignal): a handler a library's C code set
    with sigaction after the interpreter started looks like the default here and is replaced."""
    def free(handler: object) -> bool:
        return handler == signal.SIG_DFL or (owner is not None and isinstance(getattr(handler, "__self__", None), owner))

    return [s for s in signals if free(signal.getsignal(s))]
