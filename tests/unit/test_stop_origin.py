"""Which stops a supervised driver gets are the user's (megarl/stop_origin.py), with the real
supervisor and the trainer's RunControl in its driver, no Ray: user code in the driver that
signals its own process group is named as the sender (exit code 2, not the signal's), while a stop
through the command, Slurm's to every process of the job, or a `kill` of the driver's pid stays the
user's stop (128 + N)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

USER_CODE = "rollout.generate_function gen:gen"
# A driver as the trainer's step loop: a first stop waits for the step's end; the "user code" of
# mode 'killpg' signals the driver's own process group, as os.killpg(os.getpgrp(), ...) in a tool does.
DRIVER = """import os, signal, sys, time
from megarl import driver_supervisor as s
s.take_report_pipe()
from megarl.trainer.watchdog import RunControl
pid_file, mode, signum = sys.argv[1], sys.argv[2], int(sys.argv[3])
control = RunControl()
with control.handlers():
    control.deferred = True
    open(pid_file, 'w').write(str(os.getpid()))
    if mode == 'killpg':
        time.sleep(0.5)  # (the supervisor has started its sentinel in this group)
        os.killpg(os.getpgrp(), signum)
    while not control.stop_requested:
        time.sleep(0.05)
    stopped = control.stopped(f'stopped by {control.signal_name} after step 1; saved checkpoint C')
    print(stopped, file=sys.stderr)
    s.report(end=stopped.exit_code)
    sys.exit(stopped.exit_code)
"""


def _supervised(tmp_path: Path, mode: str, signum: int) -> tuple[subprocess.Popen, int]:
    """`megarl launch`'s supervisor over DRIVER (its own session, stderr piped) and the driver's pid."""
    pid_file = tmp_path / "pid"
    driver = [sys.executable, "-c", DRIVER, str(pid_file), mode, str(int(signum))]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                             f"sys.exit(supervise({driver!r}, user_code={USER_CODE!r}))"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "no driver"
        time.sleep(0.1)
    return proc, int(pid_file.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_user_code_that_signals_its_process_group_is_named_not_taken_for_the_user_s_stop(tmp_path, signum):
    proc, driver = _supervised(tmp_path, "killpg", signum)
    assert proc.wait(timeout=120) == 2
    lines = proc.stderr.read().strip().splitlines()
    said = (f"{signal.Signals(signum).name} reached the driver's whole process group (pid {driver}), not through the megarl "
            f"command (pid {proc.pid}): user code in the driver ({USER_CODE}) signalled its own process group "
            "(os.killpg(os.getpgrp(), ...), os.kill(0, ...))")
    assert lines[0] == f"megarl: {said}: stopping after this step and saving a checkpoint; send it again{'' if signum == signal.SIGINT else ' after 5 s'} to stop at once"
    assert lines[1] == (f"error: {said}; let user code signal only the processes it starts (start them with "
                        f"start_new_session=True and signal their group); to stop a run, signal the megarl command (pid {proc.pid})")
    assert lines[2:] == [f"stopped by {signal.Signals(signum).name} after step 1; saved checkpoint C"]  # (not "SIGINT (Ctrl-C)")


@pytest.mark.parametrize("to", ["command", "every-process", "driver-pid"])
def test_a_stop_from_outside_stays_the_user_s_stop(tmp_path, to):
    """Through the command; to every process of the job as Slurm sends it (the driver's whole group
    too, before the supervisor's copy comes); a `kill` of the driver's pid: SIGTERM's line and 143."""
    proc, driver = _supervised(tmp_path, "wait", signal.SIGTERM)
    time.sleep(1.0)  # (the sentinel is in the driver's group)
    if to == "every-process":
        os.killpg(driver, signal.SIGTERM)  # the driver and the sentinel first
        time.sleep(0.3)
    if to == "driver-pid":
        os.kill(driver, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert proc.stderr.read().strip().splitlines() == [
        "megarl: SIGTERM received: stopping after this step and saving a checkpoint; send it again after 5 s to stop at once",
        "stopped by SIGTERM after step 1; saved checkpoint C"]
