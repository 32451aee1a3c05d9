"""Which stops a supervised driver gets are the user's (megarl/stop_origin.py), with the real
supervisor, its sentinel and the trainer's RunControl in its driver, no Ray: code in the driver (or a
process it started) that signals the driver's own process group is named as the sender (exit code 2,
not the signal's), while a stop through the command, one to every process of the job (Slurm's, also
when the command's copy comes late), to the driver's group from outside, or to the driver's pid
stays the user's stop (128 + N)."""

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

USER_CODE = "rollout.generate_function gen:gen"


def _sentinel(group: int) -> int | None:
    """The pid of the stop sentinel in process group ``group`` once it waits for the stops (None: not yet)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
            waiting = "sigtimedwait" in open(f"/proc/{entry}/wchan").read()  # in sigwaitinfo: the stops are its
            if int(stat[2]) == group and b"stop sentinel" in open(f"/proc/{entry}/cmdline", "rb").read() and waiting:
                return int(entry)
        except (OSError, IndexError, ValueError):
            pass
    return None


def _sender_gone_first(sentinel: int, kill: list[str]) -> None:
    """Run ``kill`` (a signal to the driver's group) while the sentinel is stopped, so that the
    sender has exited and been reaped before the sentinel looks at it."""
    os.kill(sentinel, signal.SIGSTOP)
    try:
        subprocess.run(kill)
    finally:
        os.kill(sentinel, signal.SIGCONT)


# A driver as the trainer's step loop: a first stop waits for the step's end. Mode 'killpg': its
# "user code" signals the driver's own process group, as os.killpg(os.getpgrp(), ...) in a tool does;
# 'child-killpg': a process it started does (and lives on a moment); 'gone-child-killpg': `kill -TERM 0`
# run as a subprocess, exited and reaped before the sentinel looks. It starts once the sentinel in its
# group waits for them.
DRIVER = f"""import os, signal, subprocess, sys, time
from megarl import driver_supervisor as s
s.take_report_pipe()
from megarl.trainer.watchdog import RunControl
pid_file, mode, signum = sys.argv[1], sys.argv[2], int(sys.argv[3])
{inspect.getsource(_sentinel)}
{inspect.getsource(_sender_gone_first)}
deadline = time.monotonic() + 120
while (sentinel := _sentinel(os.getpgrp())) is None and time.monotonic() < deadline:
    time.sleep(0.05)
"""
DRIVER += """control = RunControl()
with control.handlers():
    control.deferred = True
    open(pid_file, 'w').write(str(os.getpid()))
    if mode == 'killpg':
        os.killpg(os.getpgrp(), signum)
    if mode == 'child-killpg':
        # the sender lives on a moment (its own copy blocked): the sentinel follows its ancestry to the driver
        subprocess.run([sys.executable, '-c', f'import os, signal, time; signal.pthread_sigmask(signal.SIG_BLOCK, {{{signum}}}); '
                        f'os.killpg({os.getpgrp()}, {signum}); time.sleep(1)'])
    if mode == 'gone-child-killpg':
        _sender_gone_first(sentinel, ['kill', '-s', signal.Signals(signum).name, '0'])
    while not control.stop_requested:
        time.sleep(0.05)
    stopped = control.stopped(f'stopped by {control.signal_name} after step 1; saved checkpoint C')
    print(stopped, file=sys.stderr)
    s.report(end=stopped.exit_code)
    sys.exit(stopped.exit_code)
"""
USERS_STOP = ["megarl: SIGTERM received: stopping after this step and saving a checkpoint; send it again after 5 s to stop at once",
              "stopped by SIGTERM after step 1; saved checkpoint C"]  # fmt: skip


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


@pytest.mark.parametrize(("signum", "mode"), [(signal.SIGTERM, "killpg"), (signal.SIGINT, "killpg"), (signal.SIGTERM, "child-killpg"),
                                             (signal.SIGTERM, "gone-child-killpg")],
                         ids=["sigterm", "sigint", "from-a-child", "from-a-child-gone-first"])  # fmt: skip
def test_code_in_the_driver_that_signals_its_process_group_is_named_not_taken_for_the_user_s_stop(tmp_path, signum, mode):
    proc, driver = _supervised(tmp_path, mode, signum)
    assert proc.wait(timeout=120) == 2
    lines = proc.stderr.read().strip().splitlines()
    name = signal.Signals(signum).name
    sender = "the driver itself" if mode == "killpg" else r"pid \d+, a process the driver started"
    how = (r"os.killpg\(os.getpgrp\(\), ...\), os.kill\(0, ...\)" if mode == "killpg"
           else r"kill -TERM 0, os.killpg\(0, ...\) in a process it started")  # fmt: skip
    said = (f"{name} was sent to the driver's process group \\(pid {driver}\\) by {sender}, not through the megarl command "
            f"\\(pid {proc.pid}\\): user code in the driver \\({USER_CODE}\\) signalled its own process group \\({how}\\)")
    again = "send it again to stop at once" if signum == signal.SIGINT else "send it again after 5 s to stop at once"
    assert re.fullmatch(f"megarl: {said}: stopping after this step and saving a checkpoint; {again}", lines[0]), lines
    assert re.fullmatch(f"error: {said}; let user code signal only the processes it starts \\(start them with "
                        f"start_new_session=True and signal their group\\); to stop a run, signal the megarl command "
                        f"\\(pid {proc.pid}\\)", lines[1]), lines  # fmt: skip
    assert lines[2:] == [f"stopped by {name} after step 1; saved checkpoint C"]  # (not "SIGINT (Ctrl-C)")


@pytest.mark.parametrize("to", ["command", "every-process", "every-process-command-late", "driver-group", "driver-group-gone-first",
                                "driver-pid"])  # fmt: skip
def test_a_stop_from_outside_stays_the_user_s_stop(tmp_path, to):
    """Through the command; to every process of the job as Slurm sends it (the driver's group first;
    also with the command's copy 4 s late: a loaded node); to the driver's group alone from outside
    (`kill -- -PGID`, also by a `kill` process gone before the sentinel looked); to the driver's
    pid: SIGTERM's own lines and 143."""
    proc, driver = _supervised(tmp_path, "wait", signal.SIGTERM)
    if to == "driver-group-gone-first":
        sentinel = _sentinel(driver)
        assert sentinel is not None, "no stop sentinel in the driver's process group"
        _sender_gone_first(sentinel, ["kill", "-s", "TERM", "--", f"-{driver}"])
    if to == "every-process-command-late":
        os.kill(proc.pid, signal.SIGSTOP)  # the command's handler cannot run before SIGCONT
    if to.startswith("every-process") or to == "driver-group":
        os.killpg(driver, signal.SIGTERM)  # the driver and the sentinel
    if to == "driver-pid":
        os.kill(driver, signal.SIGTERM)
    if to == "every-process-command-late":
        time.sleep(4)
        proc.send_signal(signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
    elif to in ("command", "every-process"):
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert proc.stderr.read().strip().splitlines() == USERS_STOP


def test_a_gone_sender_is_the_driver_s_only_as_a_subprocess_of_its_reaped_just_before(monkeypatch):
    """The sentinel's records as the driver reads them: a sender gone before the sentinel looked is
    the driver's when its pid is one the driver started and reaped just before; a pid of the
    driver's reaped long before may since belong to a process outside (pids are reused)."""
    import struct

    from megarl import stop_origin

    read, write = os.pipe()
    os.set_blocking(read, False)
    monkeypatch.setitem(stop_origin._fds, "group", read)
    monkeypatch.setattr(stop_origin, "_spawned", stop_origin.deque([101, 102], maxlen=8))
    now = time.monotonic()
    monkeypatch.setattr(stop_origin, "_reaped", {101: now - 0.1, 102: now - 600})
    monkeypatch.setattr(stop_origin, "_recorded", [])
    monkeypatch.setattr(stop_origin, "_partial", bytearray())
    try:
        for pid in (101, 102, 103):  # (103: not the driver's)
            os.write(write, struct.pack("=iiBd", signal.SIGTERM, pid, stop_origin.GONE, now))
        os.write(write, struct.pack("=iiBd", signal.SIGINT, 104, stop_origin.INSIDE, now))
        said = [stop_origin.group_sender(signal.SIGTERM) for _ in range(3)]
        assert said == [(101, True), (102, False), (103, False)]
        assert stop_origin.group_sender(signal.SIGINT) == (104, True) and stop_origin.group_sender(signal.SIGTERM) is None
    finally:
        os.close(read)
        os.close(write)
