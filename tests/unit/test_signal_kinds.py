"""The one table of what each signal means to a megarl command (megarl/signal_kinds.py)."""

import signal

from megarl.signal_kinds import (
    HANG_SIGNAL,
    OTHER_STOPS,
    STACKS_SIGNALS,
    STOPS,
    exit_code,
    signal_name,
)


def test_every_signal_that_would_end_a_command_without_a_word_is_a_stop():
    expected = {signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXCPU, signal.SIGPWR, signal.SIGSTKFLT, signal.SIGIO}
    expected |= set(range(signal.SIGRTMIN, signal.SIGRTMAX + 1)) - {HANG_SIGNAL}  # every real-time signal but the watchdog's
    assert set(OTHER_STOPS) == expected
    # handled otherwise: the named stops, the stacks request, Python's ignored ones, the faults, no-stops, no handler
    for kept in (*STOPS, *STACKS_SIGNALS, HANG_SIGNAL, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGSEGV, signal.SIGABRT,
                 signal.SIGCHLD, signal.SIGWINCH, signal.SIGTSTP, signal.SIGKILL, signal.SIGSTOP):  # fmt: skip
        assert kept not in OTHER_STOPS, signal_name(kept)


def test_signals_are_named_as_kill_l_names_them():
    assert [signal_name(s) for s in (signal.SIGALRM, signal.SIGRTMIN, signal.SIGRTMIN + 2, signal.SIGRTMAX - 3, signal.SIGRTMAX)] == [
        "SIGALRM", "SIGRTMIN", "SIGRTMIN+2", "SIGRTMAX-3", "SIGRTMAX"]  # fmt: skip
    assert signal_name(HANG_SIGNAL) == "SIGRTMIN+4"
    assert exit_code(signal.SIGALRM) == 142 and exit_code(signal.SIGTERM) == 143
