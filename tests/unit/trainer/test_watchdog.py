"""RunControl and Watchdog in this process: real signals to the test process itself."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megarl.progress import PROGRESS
from megarl.trainer.watchdog import REPEAT_WINDOW_S, RunControl, RunStopped, Watchdog, run_stoppable


def deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # the handler runs at the next bytecode boundary


def test_outside_a_step_a_signal_stops_at_once():
    control = RunControl()
    previous = signal.getsignal(signal.SIGTERM)
    with control.handlers():
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGTERM)
    assert control.signal == signal.SIGTERM and control.exit_code == 143 and control.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous  # put back


def test_a_stop_whose_interrupt_a_library_swallowed_ends_as_a_stop_not_as_its_failure():
    """A Ctrl-C inside ray.init's at-fork callbacks is swallowed, and the init then fails of it
    ("Failed to connect to GCS"): the command ends in the stop line and 130, not in exit 1."""

    def work() -> None:
        try:
            deliver(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # (what an at-fork callback does with it)
        raise ConnectionError("Failed to connect to GCS")

    with pytest.raises(RunStopped, match="^stopped by SIGINT \\(Ctrl-C\\) while converting$") as stopped:
        run_stoppable(work, "while converting")
    assert stopped.value.exit_code == 130
    def fails() -> None:
        raise ConnectionError("Failed to connect to GCS")

    with pytest.raises(ConnectionError):  # with no stop asked, the failure is the failure
        run_stoppable(fails, "while converting")


def test_inside_a_step_the_first_signal_waits_and_the_second_abandons(capsys):
    control = RunControl(save_on_signal=True)
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGINT)
        assert control.stop_requested and control.exit_code == 130
        assert "stopping after this step and saving a checkpoint" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
        control.cleaning = True
        deliver(signal.SIGTERM)  # while shutting down: noted, nothing raised
    assert "shutting down, please wait" in capsys.readouterr().err


@pytest.mark.parametrize("first", [None, signal.SIGINT], ids=["alone", "after-a-ctrl-c"])
def test_ctrl_backslash_stops_at_once_inside_a_step(capsys, first):
    """SIGQUIT (Ctrl-\\) abandons the step at once, as a second Ctrl-C does, and the stop names it
    (exit 131), also after a first Ctrl-C that only asked to stop after the step."""
    control = RunControl(save_on_signal=True)
    with control.handlers():
        control.deferred = True
        if first is not None:
            deliver(first)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGQUIT)
    assert control.signal == signal.SIGQUIT and control.exit_code == 131 and control.signal_name == "SIGQUIT (Ctrl-\\)"
    assert ("stopping after this step" in capsys.readouterr().err) == (first is not None)


def test_a_sigusr2_from_outside_writes_the_stacks_and_is_no_stop(capfd):
    """SIGUSR1 / SIGUSR2 (a user's `kill -USR2`, a scheduler's warning) write the driver's stacks
    during a run and stop nothing: the watchdog's own interrupt is a signal of its own."""
    import faulthandler

    from megarl.cli import _stacks_on_request
    from megarl.trainer.watchdog import HANG_SIGNAL

    assert HANG_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2)
    _stacks_on_request()
    try:
        control = RunControl(save_on_signal=True)
        with control.handlers():
            control.deferred = True
            deliver(signal.SIGUSR2)  # nothing raised
    finally:
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            faulthandler.unregister(signum)
    assert not control.stop_requested and control.hang is None
    assert "most recent call first" in capfd.readouterr().err


def test_the_stacks_request_works_when_sys_stderr_has_no_file_descriptor():
    """A process whose sys.stderr was replaced by a stream without a descriptor (a test's capture,
    a user's redirect) still writes its stacks to its own stderr on SIGUSR2, and lives,"""
    import subprocess
    import sys

    # and when asked again after a Python-level signal.signal put the default back (a supervisor's
    # restore of what signal.getsignal saw), which faulthandler alone does not notice
    code = ("import io, os, signal, sys, time\nsys.stderr = io.StringIO()\nfrom megarl.cli import _stacks_on_request\n"
            "_stacks_on_request()\nsignal.signal(signal.SIGUSR2, signal.SIG_DFL)\n_stacks_on_request()\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\ntime.sleep(0.5)\nprint('alive')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "alive\n"), done
    assert "most recent call first" in done.stderr, done.stderr


# SIGALRM and a real-time signal (SIGRTMIN+2: not the watchdog's own): any signal whose default
# would end the driver without a word is a stop as SIGTERM's, named, with exit code 128 + its number.
OTHER_STOPS_SENT = [(signal.SIGALRM, "SIGALRM"), (signal.SIGRTMIN + 2, "SIGRTMIN+2")]


@pytest.fixture
def sigalrm_at_default():
    """pytest-timeout holds SIGALRM (its deadline's), and RunControl leaves a handler set before it
    alone: the test gets it at its default, as a megarl command has it, and pytest-timeout's back after."""
    previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(("signum", "name"), OTHER_STOPS_SENT, ids=["sigalrm", "rt"])
def test_another_terminating_signal_is_a_stop_after_the_step_and_a_second_one_abandons(capsys, signum, name, sigalrm_at_default):
    control = RunControl(save_on_signal=True)
    previous = signal.getsignal(signum)
    with control.handlers():
        control.deferred = True
        deliver(signum)  # would have killed this process (the test with it) without a handler
        assert control.stop_requested and control.signal == signum
        assert control.exit_code == 128 + signum and control.signal_name == name
        assert f"megarl: {name} received: stopping after this step and saving a checkpoint" in capsys.readouterr().err
        deliver(signum)  # a repeat within REPEAT_WINDOW_S is the same request (SIGXCPU each CPU-second, a timer's SIGALRM)
        assert "stopping after this step" not in capsys.readouterr().err
        control.signal_at -= REPEAT_WINDOW_S  # one sent 5 s later abandons the step
        with pytest.raises(KeyboardInterrupt):
            deliver(signum)
    assert control.signal == signum and signal.getsignal(signum) is previous  # put back


def test_a_sigterm_after_a_sigalrm_stops_at_once(sigalrm_at_default):
    control = RunControl()
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGALRM)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGTERM)
    assert control.signal_name == "SIGALRM" and control.exit_code == 142  # the stop names the first signal


@pytest.mark.parametrize(("signum", "name"), OTHER_STOPS_SENT, ids=["sigalrm", "rt"])
def test_a_command_without_steps_stops_at_once_on_another_terminating_signal(signum, name, sigalrm_at_default):
    with pytest.raises(RunStopped, match=f"^stopped by {re.escape(name)} while converting$") as stopped:
        run_stoppable(lambda: deliver(signum), "while converting")
    assert stopped.value.exit_code == 128 + signum


def test_the_watchdog_s_signal_from_outside_is_a_stop_like_any_real_time_signal(capsys):
    """`kill -s SIGRTMIN+4` (no hang found): a stop after the step, named, exit code 128 + 38; Python's
    default would end the driver without a word."""
    from megarl.trainer.watchdog import HANG_SIGNAL

    control = RunControl()
    with control.handlers():
        control.deferred = True
        deliver(HANG_SIGNAL)
        assert control.signal == HANG_SIGNAL and control.hang is None
    assert control.signal_name == "SIGRTMIN+4" and control.exit_code == 128 + HANG_SIGNAL
    assert "megarl: SIGRTMIN+4 received: stopping after this step" in capsys.readouterr().err


def test_a_handler_or_an_ignore_set_before_stays():
    """A library's own handler for one of these signals (a profiler's SIGPROF) and an ignore the
    parent chose are left as they are; the watchdog's interrupt is no stop from outside either."""
    seen = []
    signal.signal(signal.SIGPROF, lambda signum, frame: seen.append(signum))
    signal.signal(signal.SIGVTALRM, signal.SIG_IGN)
    try:
        control = RunControl()
        with control.handlers():
            control.deferred = True
            deliver(signal.SIGPROF)
            deliver(signal.SIGVTALRM)
        assert seen == [signal.SIGPROF] and not control.stop_requested
    finally:
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
        signal.signal(signal.SIGVTALRM, signal.SIG_DFL)


def test_an_inner_run_control_takes_the_other_stops_from_an_outer_one(sigalrm_at_default):
    outer, inner = RunControl(), RunControl()
    with outer.handlers():
        with inner.handlers():
            inner.deferred = True
            deliver(signal.SIGALRM)
        assert inner.signal == signal.SIGALRM and outer.signal is None


def test_a_second_stop_of_another_kind_that_abandons_the_step_is_named():
    # Before: a Ctrl-C soon after a SIGTERM (user code's, or Slurm's) abandoned the step, and the
    # stop line said only "stopped by SIGTERM during step 2 (abandoned)": the Ctrl-C's doing, unnamed.
    control = RunControl()
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGTERM)
        assert control.abandoned_by == ""
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
        control.cleaning = True
    assert control.signal == signal.SIGTERM and control.abandoned_by == "SIGINT (Ctrl-C) received"
    again = RunControl()
    with again.handlers():
        again.deferred = True
        deliver(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)  # the same stop twice: the stop line's signal says it
        again.cleaning = True
    assert again.abandoned_by == ""


def test_a_second_ctrl_c_stops_at_once_however_soon(capsys):
    control = RunControl()
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)  # within REPEAT_WINDOW_S: a person pressed it twice
    assert "send it again to stop at once\n" in capsys.readouterr().err


def test_after_the_run_a_late_hang_interrupt_sends_nothing(monkeypatch):
    """The watchdog thread may outlive Watchdog.__exit__'s join: by the time HANG_SIGNAL's handler
    is put back (its default ends the process), the hang interrupt is off, and it sends nothing."""
    from megarl.trainer.watchdog import HANG_SIGNAL

    control = RunControl()
    installed_as_put_back = []
    put_back = signal.signal

    def recording(signum, handler):  # (the standard library's signal.signal, watched)
        if signum == HANG_SIGNAL and handler == signal.SIG_DFL:
            installed_as_put_back.append(control.installed)
        return put_back(signum, handler)

    with control.handlers():
        monkeypatch.setattr(signal, "signal", recording)
    monkeypatch.undo()
    assert installed_as_put_back == [False]
    assert signal.getsignal(HANG_SIGNAL) == signal.SIG_DFL and not control.installed
    control.interrupt_for_hang("late")  # would kill this process
    time.sleep(0.2)
    assert control.hang == "late"


def test_the_first_signal_names_what_the_stop_writes(capsys):
    control = RunControl(saves="the model")  # megarl sft: a stop writes the model, not a checkpoint
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGINT)
    assert "stopping after this step and saving the model; send it again" in capsys.readouterr().err


def test_a_sigterm_repeated_at_once_is_the_same_request(capsys, monkeypatch):
    # Slurm's preemption signals every process of the job, and the batch script forwards it too.
    control = RunControl()
    with control.handlers():
        control.deferred = True
        deliver(signal.SIGTERM)
        deliver(signal.SIGTERM)  # within REPEAT_WINDOW_S: no KeyboardInterrupt
        assert control.stop_requested and control.exit_code == 143
        monkeypatch.setattr(control, "signal_at", time.monotonic() - 60)  # a TERM a minute later abandons
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGTERM)
    assert capsys.readouterr().err.count("stopping after this step") == 1


def test_the_watchdog_interrupts_a_stuck_driver(tmp_path):
    control = RunControl()
    with control.handlers(), pytest.raises(KeyboardInterrupt), Watchdog(control, 1.0, {}, tmp_path):
        PROGRESS.mark("reward", 7)
        time.sleep(60)  # stuck: no phase moves
    assert control.hang is not None
    assert "in phase 'reward' of step 7 (trainer.hang_timeout_s=1)" in control.hang
    assert "no worker call was in flight" in control.hang
    assert "most recent call first" in (tmp_path / "driver_stacks.log").read_text()


HUNG_UP_CHILD = """
import json, sys, time
from megarl.trainer.watchdog import RunControl
control = RunControl()
with control.handlers():
    control.deferred = True  # inside a step: the first stop signal waits for its end
    print("ready", flush=True)
    while not control.stop_requested:
        time.sleep(0.01)
    for _ in range(3):  # the terminal is gone: these must not raise (EIO)
        print("after the hangup", file=sys.stderr, flush=True)
        print("after the hangup", flush=True)
    open(sys.argv[1], "w").write(json.dumps([control.signal, control.exit_code, control.signal_name]))
    time.sleep(2)  # the shell's SIGHUP lands while the handlers are in place
"""


def test_a_hung_up_terminal_asks_to_stop_and_output_goes_nowhere(tmp_path):
    # A closed terminal: the kernel sends SIGHUP to the session's leader and every write to the
    # terminal fails from then on; the shell then sends SIGHUP to the job too (the same request).
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    tty = os.ttyname(slave)
    result = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}  # this tree's megarl
    proc = subprocess.Popen([sys.executable, "-c", HUNG_UP_CHILD, str(result)], stdin=slave, stdout=slave, stderr=slave,
                            env=env, start_new_session=True, preexec_fn=lambda: os.close(os.open(tty, os.O_RDWR)))
    os.close(slave)
    try:
        seen = b""
        while b"ready" not in seen:
            seen += os.read(master, 1024)
    finally:
        os.close(master)  # the hangup
    os.killpg(proc.pid, signal.SIGHUP)  # the shell's, within the repeat window
    assert proc.wait(timeout=60) == 0
    assert json.loads(result.read_text()) == [signal.SIGHUP, 129, "SIGHUP (terminal closed)"]
