"""`megarl launch`'s supervisor (megarl/driver_supervisor.py) with real child processes, no Ray:
a driver that ends without reporting its end (as Ray's quick exit ends one whose raylet died)
gets one `error:` line from the supervisor; one that reports passes its exit code through;
SIGTERM to the supervisor reaches the driver, a Ctrl-C to the process group is not doubled, and
the driver dies with the supervisor."""

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.driver_stderr import may_become_ray
from megarl.driver_supervisor import supervise
from megarl.rank_logs import START_LINE
from megarl.signal_kinds import signal_name
from megarl.tagged_processes import DRIVER_TAG_ENV, new_tag

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
RESUME = "megarl launch run.yaml trainer.resume=auto"


def _driver(body: str) -> list[str]:
    """A child that takes the supervisor's pipe as megarl's CLI does, then runs ``body``."""
    head = "import os, signal, sys, time\nfrom megarl import driver_supervisor as s\ns.take_report_pipe()\n"
    return [sys.executable, "-c", head + body]


def _fake_raylet(session: Path | None) -> str:
    """Driver code starting ``raylet``: a stand-in for an embedded Ray's raylet, as the supervisor
    finds one among the driver's children (named raylet, a raylet's command line, its session's
    socket path when ``session`` is given), dying with the driver."""
    socket_arg = f"'--raylet_socket_name={session}/sockets/raylet', " if session is not None else ""
    return ("import subprocess, ctypes\n"
            "name = 'import ctypes, time; ctypes.CDLL(None).prctl(15, b\"raylet\"); time.sleep(120)'\n"
            f"raylet = subprocess.Popen([sys.executable, '-c', name, {socket_arg}'--node_id=ab12cd34ef56aa', "
            "'--node_ip_address=127.0.0.1'], preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))\n")


def test_quick_exit_after_ray_started_names_the_node_its_logs_and_the_resume(capsys, tmp_path, refused_port):
    ray = {"ip": "127.0.0.1", "node_id": "ab12cd34ef56aa", "logs": str(tmp_path / "logs"), "raylet": f"127.0.0.1:{refused_port}"}
    code = supervise(_driver(f"s.report(resume={RESUME!r})\ns.report(ray={ray!r})\nos._exit(1)"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the Ray node under the run died: node 127.0.0.1 (id ab12cd34ef56)")
    assert "exited with code 1" in err[0] and "its raylet does not answer" in err[0]
    assert str(tmp_path / "logs" / "raylet.out") in err[0] and err[0].endswith(f"resume with: {RESUME}")


def test_sigkill_before_ray_is_named(capsys):
    code = supervise(_driver("os.kill(os.getpid(), signal.SIGKILL)"))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: the driver process") and "was killed by SIGKILL" in err and "before Ray started" in err


def test_a_driver_killed_before_its_log_exists_names_no_log(capsys, tmp_path):
    """Killed in its checks (the reward import check), before output_dir exists: the line names
    no driver's log, since there is none yet; the output so far is on the terminal."""
    log = tmp_path / "run" / "logs" / "driver.log"
    code = supervise(_driver(f"s.report(log={str(log)!r})\ntime.sleep(0.5)\nos.kill(os.getpid(), signal.SIGKILL)"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "was killed by SIGKILL" in err
    assert "driver's log" not in err and "driver.log" not in err and "its output is above" in err, err


def test_the_line_names_only_the_user_code_the_config_has_the_driver_run(capsys, tmp_path):
    """A config whose only user code is reward.custom (run by reward workers) has a driver that
    runs none of it; one with a dataset class names that class, not a generate function or tools."""
    from megarl.commands.supervision import driver_user_code
    from megarl.config.loading import load_config

    assert driver_user_code(load_config(str(TINY), ["reward.custom.path=r.py", "reward.custom.name=f"])) is None
    cfg = load_config(str(TINY), ["data.custom_cls.path=d.py", "data.custom_cls.name=Rows"])
    assert driver_user_code(cfg) == "data.custom_cls Rows" and driver_user_code(cfg, dataset=False) is None
    code = supervise(_driver("os.kill(os.getpid(), signal.SIGKILL)"), user_code=None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "user code" not in err and "runs none of your code" in err, err
    supervise(_driver("os._exit(3)"), user_code=driver_user_code(cfg))
    err = capsys.readouterr().err.strip()
    assert "user code in the driver (data.custom_cls Rows) calling os._exit" in err and "generate function" not in err, err


def test_reported_end_passes_the_exit_code_through(capsys):
    assert supervise(_driver("s.report(end=3)\nsys.exit(3)")) == 3
    assert capsys.readouterr().err == ""
    # a teardown that aborts after the end was reported (Ray's C++ after a SIGTERM): the reported code
    assert supervise(_driver("s.report(end=143)\nos.abort()")) == 143
    assert supervise(_driver("s.report(end=None)\nsys.exit(1)")) == 1  # an exception on the way out: no code reported
    assert capsys.readouterr().err == ""


def test_real_cli_driver_reports_its_own_error():
    """The CLI's own ending (a plan error) is reported: the driver's line alone, exit code 2."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                           f"sys.exit(supervise([sys.executable, '-m', 'megarl.cli', 'plan', {str(TINY)!r}, 'actor.parallel.pp=3']))"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "the driver process" not in proc.stderr


def test_a_stop_during_the_driver_s_teardown_ends_it_with_its_reported_code_and_no_traceback():
    """A stop that reaches the driver after it reported its end, in an atexit finalizer (torch's,
    Ray's): before, Python's handler raised KeyboardInterrupt there, and its traceback followed the
    run's last line."""
    driver = ("import atexit, os, signal, sys, time\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5), print('finalized', file=sys.stderr)))\n"
              f"from megarl.cli import main\nsys.exit(main(['plan', {str(TINY)!r}, 'actor.parallel.pp=3']))\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                           f"sys.exit(supervise([sys.executable, '-c', {driver!r}]))"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr and "finalized" not in proc.stderr, proc.stderr


def _supervisor(tmp_path: Path, body: str) -> tuple[subprocess.Popen, Path]:
    """A supervisor process (its own process group) over a driver running ``body``; waits until the
    driver wrote its pid to <tmp_path>/pid."""
    pid_file = tmp_path / "pid"
    driver = _driver(f"{body}\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)")
    return _supervising(driver, pid_file), pid_file


def _supervising(driver: list[str], pid_file: Path) -> subprocess.Popen:
    """A supervisor process (its own process group, stderr piped) over ``driver``, once the driver
    wrote its pid to ``pid_file``."""
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; from megarl.driver_supervisor import supervise; sys.exit(supervise({driver!r}))"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    return proc


ENDS_ON_SIGNAL = "def end(signum, frame):\n    s.report(end=128 + signum)\n    os._exit(128 + signum)\nsignal.signal(signal.SIGTERM, end)\nsignal.signal(signal.SIGINT, end)"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_alone_reaches_the_driver(tmp_path, signum):
    """`kill -TERM|-INT <pid of megarl launch>` (a script, an orchestrator): no process group carries it."""
    proc, _ = _supervisor(tmp_path, ENDS_ON_SIGNAL)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    assert proc.stderr.read() == ""


def test_ctrl_c_to_the_group_reaches_the_driver_once(tmp_path):
    """A second SIGINT would kill this driver (its handler is gone after the first)."""
    once = ENDS_ON_SIGNAL.replace("def end(signum, frame):\n", "def end(signum, frame):\n    signal.signal(signal.SIGINT, signal.SIG_DFL)\n    time.sleep(1)\n")
    proc, _ = _supervisor(tmp_path, once)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.stderr.read() == ""


def test_driver_dies_with_its_supervisor(tmp_path):
    proc, pid_file = _supervisor(tmp_path, "")
    driver = int(pid_file.read_text())
    proc.kill()
    proc.wait(timeout=60)
    for _ in range(600):  # PR_SET_PDEATHSIG: SIGKILL
        try:
            if Path(f"/proc/{driver}/stat").read_text().split(") ")[1].startswith("Z"):  # dead, not yet reaped
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        os.kill(driver, signal.SIGKILL)
        raise AssertionError("the driver outlived its supervisor")


def test_a_driver_whose_supervisor_ended_before_it_could_watch_it_ends_at_once():
    """The supervisor dying between the fork and the driver's PR_SET_PDEATHSIG would leave a driver
    no death signal ever reaches (running without its supervisor's lock): here its parent is not
    the supervisor named, as after such a death (re-parented)."""
    from megarl.driver_supervisor import _die_with_parent

    this, not_its_parent = os.getpid(), os.getppid()
    started = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: _die_with_parent(not_its_parent))  # fmt: skip
    assert started.returncode == -signal.SIGKILL and started.stdout == ""
    alive = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60,
                           preexec_fn=lambda: _die_with_parent(this))  # fmt: skip
    assert alive.returncode == 0 and alive.stdout == "ran\n"


def test_a_supervised_driver_names_the_command_s_pid(tmp_path):
    """What a lock's refusal names (and a user would kill) is the `megarl launch` process's pid."""
    out = tmp_path / "pids"
    supervise(_driver(f"open({str(out)!r}, 'w').write(f'{{os.getppid()}} {{s.command_pid()}}')\ns.report(end=0)"))
    parent, named = out.read_text().split()
    assert parent == named == str(os.getpid())


def test_a_stop_before_the_driver_s_handlers_is_a_stop_not_an_error(tmp_path):
    """SIGTERM to `megarl launch` while its driver is still importing (default handlers): the
    driver dies of it; that is the user's stop (143), not a silent death."""
    proc, _ = _supervisor(tmp_path, "")  # the driver keeps Python's default SIGTERM
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert proc.stderr.read().strip() == "stopped by SIGTERM while starting; nothing was trained or saved"


# A driver in its step loop under megarl's real signal handling (RunControl), ending as the trainer's loop does.
STEP_LOOP = ("from megarl.trainer.watchdog import RunControl\ncontrol = RunControl()\n"
             "with control.handlers():\n    control.deferred = True\n    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
             "    try:\n        time.sleep(120)\n    except KeyboardInterrupt:\n"
             "        print(f'stopped by {control.signal_name} during step 1 (abandoned); resume with: R', file=sys.stderr)\n"
             "        s.report(end=control.exit_code)\n        sys.exit(control.exit_code)\n")  # fmt: skip


@pytest.mark.parametrize("to", ["command", "command-group", "driver-alone"])
def test_ctrl_backslash_stops_the_run_at_once_with_its_line(tmp_path, to):
    """SIGQUIT (Ctrl-\\, `kill -QUIT`) to `megarl launch`, its process group or the driver alone:
    the driver stops at once with its stop line and exit code 131 (no silent death with a core)."""
    pid_file = tmp_path / "pid"
    driver = [sys.executable, "-c", "import os, signal, sys, time\nfrom megarl import driver_supervisor as s\n"
              "s.take_report_pipe()\n" + STEP_LOOP, str(pid_file)]  # fmt: skip
    proc = _supervising(driver, pid_file)
    {"command": lambda: proc.send_signal(signal.SIGQUIT), "command-group": lambda: os.killpg(proc.pid, signal.SIGQUIT),
     "driver-alone": lambda: os.kill(int(pid_file.read_text()), signal.SIGQUIT)}[to]()  # fmt: skip
    assert proc.wait(timeout=60) == 131
    assert proc.stderr.read().strip() == "stopped by SIGQUIT (Ctrl-\\) during step 1 (abandoned); resume with: R"


# A driver whose step loop stops after its step on a first stop signal, as the trainer's loop does.
STOPS_AFTER_THE_STEP = ("from megarl.trainer.watchdog import RunControl\ncontrol = RunControl()\n"
                        "with control.handlers():\n    control.deferred = True\n    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                        "    while not control.stop_requested:\n        time.sleep(0.05)\n"
                        "    print(f'stopped by {control.signal_name} after step 1; saved checkpoint C', file=sys.stderr)\n"
                        "    s.report(end=control.exit_code)\n    sys.exit(control.exit_code)\n")  # fmt: skip
OTHER_STOPS_SENT = [signal.SIGALRM, signal.SIGRTMIN + 2, signal.SIGRTMIN + 4]  # (SIGRTMIN+4: the watchdog's own)


@pytest.mark.parametrize("signum", OTHER_STOPS_SENT, ids=["sigalrm", "rt", "hang"])
def test_another_terminating_signal_to_the_command_stops_the_run_after_its_step(tmp_path, signum):
    """`kill -ALRM <pid of megarl launch>` (any signal whose default would end it without a word):
    forwarded to the driver, which stops after its step with its line; exit code 128 + N."""
    pid_file = tmp_path / "pid"
    driver = [sys.executable, "-c", "import os, signal, sys, time\nfrom megarl import driver_supervisor as s\n"
              "s.take_report_pipe()\n" + STOPS_AFTER_THE_STEP, str(pid_file)]  # fmt: skip
    proc = _supervising(driver, pid_file)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    name = signal_name(signum)
    assert proc.stderr.read().strip().splitlines() == [
        f"megarl: {name} received: stopping after this step and saving a checkpoint; send it again after 5 s to stop at once",
        f"stopped by {name} after step 1; saved checkpoint C"]  # fmt: skip


@pytest.mark.parametrize("signum", OTHER_STOPS_SENT, ids=["sigalrm", "rt", "hang"])
def test_another_terminating_signal_before_the_driver_s_handlers_ends_the_start_with_its_line(tmp_path, signum):
    proc, _ = _supervisor(tmp_path, "")  # the driver keeps Python's defaults: the signal kills it
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    assert proc.stderr.read().strip() == f"stopped by {signal_name(signum)} while starting; nothing was trained or saved"


def test_a_driver_killed_by_a_real_time_signal_from_outside_is_named(capsys):
    """Sent to the driver alone (not through the command): its silent death, the signal named as
    `kill -l` names it (a real-time signal has no name of its own in Python)."""
    code = supervise(_driver("os.kill(os.getpid(), signal.SIGRTMIN + 2)"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "was killed by SIGRTMIN+2 without reporting an error" in err, err


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2], ids=["usr1", "usr2"])
def test_sigusr1_to_the_command_makes_the_driver_write_its_stacks_and_go_on(tmp_path, signum):
    """`kill -USR1 <megarl launch>` (or -USR2): the driver's Python stacks on stderr, the run goes
    on (Python's default for them ended the supervisor, then the driver, without a word)."""
    pid_file, done = tmp_path / "pid", tmp_path / "done"
    body = ("from megarl.cli import _stacks_on_request\n_stacks_on_request()\n"
            "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "def waiting_for_the_user():\n    deadline = time.monotonic() + 120\n"
            "    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n        time.sleep(0.05)\n"
            "waiting_for_the_user()\ns.report(end=0)\n")  # fmt: skip
    driver = [sys.executable, "-c", "import os, signal, sys, time\nfrom megarl import driver_supervisor as s\n"
              "s.take_report_pipe()\n" + body, str(pid_file), str(done)]  # fmt: skip
    proc = _supervising(driver, pid_file)
    proc.send_signal(signum)
    time.sleep(1.0)  # the stacks written, the driver still waiting
    assert proc.poll() is None
    done.touch()
    assert proc.wait(timeout=60) == 0
    err = proc.stderr.read()
    assert "most recent call first" in err and "waiting_for_the_user" in err, err
    said = f"megarl: the Python stacks above are every thread of pid {pid_file.read_text()}, written on request ({signal.Signals(signum).name}); the command goes on"
    assert err.strip().splitlines()[-1] == said, err  # after the stacks, what they were


def test_ctrl_backslash_before_the_driver_s_handlers_is_a_stop(tmp_path):
    """SIGQUIT while the driver still has Python's default (death with a core): a stop, 131."""
    proc, _ = _supervisor(tmp_path, "import resource\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file")
    proc.send_signal(signal.SIGQUIT)
    assert proc.wait(timeout=60) == 131
    assert proc.stderr.read().strip() == "stopped by SIGQUIT (Ctrl-\\) while starting; nothing was trained or saved"


# A stand-in for an embedded raylet: the driver's child, killed with it (Ray's fate sharing).
RAYLET = ("import subprocess, ctypes\n"
          "raylet = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
          "preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))\n")  # fmt: skip


def _node(tmp_path: Path, port: int) -> str:
    """The driver's report of its node: the raylet stand-in's pid, at an address nothing answers."""
    (tmp_path / "driver.log").touch()  # the driver's log, as a launch's driver has opened it by then
    return (f"s.report(resume={RESUME!r}, log={str(tmp_path / 'driver.log')!r})\n"
            f"s.report(ray=dict(ip='127.0.0.1', node_id='ab12cd34ef56aa', logs={str(tmp_path)!r}, "
            f"raylet='127.0.0.1:{port}', raylet_pid=raylet.pid))\ntime.sleep(1)\n")  # fmt: skip


@pytest.mark.parametrize("raylet_first", [False, True], ids=["raylet-alive", "raylet-seen-dead-first"])
@pytest.mark.parametrize("exit_code", [0, 9])
def test_a_driver_that_exits_on_its_own_is_blamed_not_its_embedded_raylet(capsys, tmp_path, exit_code, raylet_first, refused_port):
    """User code's os._exit(0) or os._exit(9) in the driver: its raylet dies with it (and answers
    no more), and may even be seen dead before the driver can be reaped (here, with
    ``raylet_first``, it surely is: the raylet is killed a second before the driver exits). Ray
    ends a driver for its raylet with exit code 1 only, so the line names the driver's own death."""
    first = "os.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(1)\n" if raylet_first else ""
    code = supervise(_driver(RAYLET + _node(tmp_path, refused_port) + first + f"os._exit({exit_code})"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the driver process (pid "), err
    assert f"exited with code {exit_code} without reporting an error: user code in the driver" in err[0] and "os._exit" in err[0]
    assert "Ray node" not in err[0] and "before Ray started" not in err[0]
    assert f"the driver's log: {tmp_path / 'driver.log'}" in err[0] and err[0].endswith(f"resume with: {RESUME}")


def test_a_raylet_that_died_before_its_driver_is_the_node_s_death(capsys, tmp_path, refused_port):
    """The raylet dies first (here killed; the driver keeps it unreaped, a zombie, as Ray does),
    then the driver ends without a word, as Ray's quick exit ends it a moment later."""
    body = RAYLET + _node(tmp_path, refused_port) + "os.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(2)\nos._exit(1)"
    code = supervise(_driver(body))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the Ray node under the run died: node 127.0.0.1 (id ab12cd34ef56)"), err
    assert "exited with code 1 (its raylet died first)" in err[0] and err[0].endswith(f"resume with: {RESUME}")


def test_a_driver_killed_from_outside_is_named_with_its_signal(tmp_path, refused_port):
    """kill -9 of the driver child during a run: its own death by SIGKILL, not its raylet's."""
    proc, pid_file = _supervisor(tmp_path, RAYLET + _node(tmp_path, refused_port))
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert proc.wait(timeout=60) == 2
    err = proc.stderr.read().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the driver process (pid "), err
    assert "was killed by SIGKILL without reporting an error" in err[0] and "Ray node" not in err[0]


def test_an_in_process_driver_s_silent_exit_0_is_an_error(capsys):
    """--in-process (no Ray): os._exit(0) in user code is exit code 2 and one line, not success."""
    code = supervise(_driver("os._exit(0)"), ray=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "exited with code 0 without reporting an error: user code" in err[0], err
    assert "Ray" not in err[0]


# Ray's real lines, as its core worker logs them before its quick exit (exit code 1).
PLASMA_LOST = ("[2026-11-29 14:13:45,428 W 1 1] connection.cc:216: The connection to the plasma store is failed. "
               "Terminate the process. Status: IOError: Connection reset by peer\\n")  # fmt: skip
NOT_REGISTERED = ("[2026-11-29 17:01:02,003 C 1 1] core_worker_process.cc:282: Failed to register worker to Raylet: "
                  "IOError: [RayletClient] Unable to register worker with raylet. Failed to read data from the socket: "
                  "End of file worker_id=01000000ffffffffffffffffffffffffffffffffffffffffffffffff\\n")  # fmt: skip


@pytest.mark.parametrize("lost", [PLASMA_LOST, NOT_REGISTERED], ids=["plasma-store-lost", "not-registered"])
def test_ray_s_own_log_of_the_raylet_s_loss_names_the_node(capsys, tmp_path, lost, refused_port):
    """Ray's core worker often ends the driver within a moment of its raylet's death, before the
    supervisor looks again; what it logged last (its real line) says the raylet went first, also
    for a raylet killed as Ray started (the driver could not register with it)."""
    log = f"open(os.path.join({str(tmp_path)!r}, f'python-core-driver-01000000ff_{{os.getpid()}}.log'), 'w').write({lost!r})\n"
    code = supervise(_driver(RAYLET + _node(tmp_path, refused_port) + log + "os._exit(1)"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the Ray node under the run died: node 127.0.0.1"), err
    assert "exited with code 1 (its raylet died first)" in err[0]


def test_ray_s_log_does_not_blame_the_node_for_an_exit_ray_never_gives(capsys, tmp_path, refused_port):
    """Ray's log ends in the raylet's loss, but the driver exited with code 0 (Ray's quick exit
    is code 1): user code ended it, and the line says so."""
    log = f"open(os.path.join({str(tmp_path)!r}, f'python-core-driver-01000000ff_{{os.getpid()}}.log'), 'w').write({PLASMA_LOST!r})\n"
    code = supervise(_driver(RAYLET + _node(tmp_path, refused_port) + log + "os._exit(0)"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "exited with code 0 without reporting an error: user code" in err[0] and "Ray node" not in err[0], err


def test_a_driver_killed_after_its_raylet_died_is_named_by_its_own_death(capsys, tmp_path, refused_port):
    """kill -9 of the driver: its raylet can be seen dead before the driver is reapable (its
    children get their parent-death signal before it becomes a zombie). Here the raylet is seen
    dead first for sure, then the driver is killed: the driver's death by SIGKILL is the line, as
    Ray ends a driver for its raylet with an exit, never with a kill."""
    body = RAYLET + _node(tmp_path, refused_port) + "os.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(1)\nos.kill(os.getpid(), signal.SIGKILL)"
    code = supervise(_driver(body))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the driver process (pid "), err
    assert "was killed by SIGKILL without reporting an error" in err[0] and "Ray node" not in err[0]


def test_a_raylet_that_dies_as_ray_starts_is_the_node_s_death_before_the_driver_reports_it(capsys, tmp_path):
    """The raylet killed right after Ray started, before the driver said where its node is: the
    supervisor finds the raylet among the driver's children itself (its name, its command line),
    so the line is the node's, not user code's "before Ray started"."""
    session = tmp_path / "session_2026-11-29_12-00-00_000000_1"
    raylet = (_fake_raylet(session) +
              "time.sleep(1.5)\nos.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(2)\nos._exit(1)")  # fmt: skip
    code = supervise(_driver(f"s.report(resume={RESUME!r})\ns.report_ray_starting()\n" + raylet))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the Ray node under the run died: node 127.0.0.1 (id ab12cd34ef56)"), err
    assert "(its raylet died first)" in err[0] and str(session / "logs" / "raylet.out") in err[0]


def test_a_driver_stuck_in_ray_init_after_its_raylet_died_is_ended_with_the_node_s_line(capsys, tmp_path, monkeypatch):
    """The raylet killed inside ray.init: Ray's start waits 30 s for the node in its C code, where
    the driver can do nothing. The supervisor, which saw the raylet die before the driver's
    report, ends the driver once START_GRACE_S passed and gives the line the driver would have
    given then (naming the raylet and its logs), at once instead of 30 s later."""
    from megarl import driver_supervisor

    monkeypatch.setattr(driver_supervisor, "START_GRACE_S", 1.0)
    session = tmp_path / "session_2026-11-29_12-00-00_000000_1"
    raylet = (_fake_raylet(session) +
              f"open({str(tmp_path / 'raylet.pid')!r}, 'w').write(str(raylet.pid))\n"
              "time.sleep(1.5)\nos.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(120)")  # fmt: skip
    started = time.monotonic()
    code = supervise(_driver(f"s.report(resume={RESUME!r})\ns.report_ray_starting()\n" + raylet))
    assert time.monotonic() - started < 60  # not the driver's 120 s (generous: a loaded machine)
    lines = capsys.readouterr().err.strip().splitlines()
    pid = (tmp_path / "raylet.pid").read_text()
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0] == (f"error: the Ray node under the run died as Ray started: its raylet (pid {pid}) died; check this "
                        f"machine (killed processes, memory: dmesg) and the raylet's logs {session / 'logs' / 'raylet.out'} and "
                        "raylet.err, then run the same command again")  # fmt: skip


@pytest.mark.parametrize("described", [True, False], ids=["node-reported", "node-not-described"])
def test_a_raylet_that_dies_after_ray_started_waits_for_the_driver_and_names_the_node(capsys, tmp_path, monkeypatch, described):
    """The raylet found among the driver's children while Ray started, killed mid-run (after the
    driver reported that ray.init ended, with its node or, when Ray's internals could not be
    read, without): not "as Ray started". The driver is waited for past START_GRACE_S (Ray ends
    it when it notices; here it exits as Ray does, with code 1) and the line is the running
    node's, with the command that resumes."""
    from megarl import driver_supervisor

    monkeypatch.setattr(driver_supervisor, "START_GRACE_S", 0.5)
    session = tmp_path / "session_2026-11-29_12-00-00_000000_1"
    # report_ray_node itself, in a process without Ray: it still says that ray.init ended
    ended = ("s.report(ray_starting=False, ray=dict(ip='127.0.0.1', node_id='ab12cd34ef56aa', "
             f"logs={str(session / 'logs')!r}, raylet='127.0.0.1:1', raylet_pid=raylet.pid))\n" if described else "s.report_ray_node()\n")  # fmt: skip
    body = (f"s.report(resume={RESUME!r})\ns.report_ray_starting()\n" + _fake_raylet(session) + "time.sleep(1.5)\n" + ended + "time.sleep(1)\nos.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(3)\nos._exit(1)")  # fmt: skip
    code = supervise(_driver(body))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the Ray node under the run died: node 127.0.0.1 (id ab12cd34ef56)"), err
    assert "exited with code 1 (its raylet died first)" in err[0] and "as Ray started" not in err[0]
    assert str(session / "logs" / "raylet.out") in err[0] and err[0].endswith(f"resume with: {RESUME}")


def test_a_stop_whose_ray_shutdown_ends_the_raylet_is_the_driver_s_stop_not_the_node_s_death(tmp_path):
    """A Ctrl-C inside ray.init: the driver's ray.shutdown ends the raylet first, then waits about a
    second for each of Ray's other processes, past START_GRACE_S. The supervisor waits for it
    and its own line, instead of ending it as stuck with the node's."""
    pid_file = tmp_path / "pid"
    body = ("s.report_ray_starting()\n" + _fake_raylet(None) +
            "def shutdown(signum, frame):\n    os.kill(raylet.pid, signal.SIGKILL)\n    time.sleep(3)\n"
            "    print('stopped by SIGINT (Ctrl-C) while starting; nothing was trained or saved', file=sys.stderr)\n"
            "    s.report(end=130)\n    os._exit(130)\n"
            "signal.signal(signal.SIGINT, shutdown)\ntime.sleep(1)\n"
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from megarl import driver_supervisor as d; d.START_GRACE_S = 1.0; "
                             f"sys.exit(d.supervise({_driver(body)!r}))"], stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.stderr.read().strip() == "stopped by SIGINT (Ctrl-C) while starting; nothing was trained or saved"


def test_an_attached_driver_s_children_are_not_searched_for_a_raylet_after_its_report(capsys, tmp_path):
    """A driver attached to a cluster (--address) reports a raylet that is not its child (no pid,
    an address that answers); the supervisor stops looking among its children then. A child
    named raylet that it starts afterwards and that dies is not the node's death: the driver's
    own silent exit is the line."""
    with socket.socket() as cluster_raylet:
        cluster_raylet.bind(("127.0.0.1", 0))
        cluster_raylet.listen()
        address = f"127.0.0.1:{cluster_raylet.getsockname()[1]}"
        session = tmp_path / "session_2026-11-29_12-00-00_000000_1"
        report = f"s.report(resume={RESUME!r})\ns.report(ray=dict(ip='127.0.0.1', node_id='ab12cd34ef56aa', logs={str(tmp_path)!r}, raylet={address!r}, raylet_pid=None))\n"
        other = ("time.sleep(1)\n" + _fake_raylet(session) +
                 "time.sleep(1.5)\nos.kill(raylet.pid, signal.SIGKILL)\ntime.sleep(2)\nos._exit(1)")  # fmt: skip
        code = supervise(_driver(report + other))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: the driver process (pid "), err
    assert "exited with code 1 without reporting an error" in err[0] and "Ray node" not in err[0]


# A stand-in for Ray's workers whose raylet died: started by the driver's child (the raylet), re-parented
# when that one is killed, alive past the driver (a real worker notices its raylet's loss after 20-40 s).
ORPHAN = ("import subprocess, ctypes\n"
          "raylet = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; "
          "w = subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(120)\"], start_new_session=True); "
          "open(sys.argv[1], \"w\").write(str(w.pid)); time.sleep(120)', {pids!r}])\n"
          "while not (os.path.exists({pids!r}) and os.path.getsize({pids!r})): time.sleep(0.05)\n"
          "os.kill(raylet.pid, signal.SIGKILL)\nraylet.wait()\n")  # fmt: skip


# Stand-ins for another run's processes: started with another tag, one of them this run's tag and a digit more.
OTHER_RUNS = ("tag = os.environ['MEGARL_DRIVER_TAG']\n"
              "others = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True, "
              "env={{**os.environ, 'MEGARL_DRIVER_TAG': t}}).pid for t in (tag + '0', '1-2')]\n"
              "open({others!r}, 'w').write(' '.join(map(str, others)))\n")  # fmt: skip


@pytest.mark.parametrize("ending", ["s.report(end=0)\nsys.exit(0)", "os._exit(1)"], ids=["reported-end", "silent-end"])
def test_what_the_driver_leaves_behind_ends_with_it_and_nothing_else(capsys, tmp_path, ending):
    """Processes the driver's tree started that outlive it, re-parented (Ray's workers after a
    raylet's kill -9), are ended before the command exits; a process of another run is left
    alone: one with no tag, one with another run's tag, one whose tag starts with this run's."""
    pids, others_file = tmp_path / "worker.pid", tmp_path / "others.pid"
    untagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # not the driver's: no tag
    others: list[int] = []
    try:
        supervise(_driver(ORPHAN.format(pids=str(pids)) + OTHER_RUNS.format(others=str(others_file)) + ending))
        worker = int(pids.read_text())
        others = [int(pid) for pid in others_file.read_text().split()]
        assert not _running(worker), "the driver's orphaned worker outlived the command"
        assert untagged.poll() is None and len(others) == 2 and all(_running(pid) for pid in others)  # other runs': untouched
    finally:
        untagged.kill()
        untagged.wait()
        left = [int(pids.read_text())] if pids.exists() and pids.read_text() else []
        for pid in left + others:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    capsys.readouterr()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("log", ["Traceback ...\n", "", "start-line"], ids=["a-rank-wrote", "nothing-written", "start-line-only"])
def test_rank_logs_a_killed_driver_leaves_are_named_or_removed(capsys, tmp_path, log):
    """`megarl convert`'s ranks log in a temp folder its driver removes unless a rank failed; a
    driver ended at the C level (Ray's quick exit) removes nothing: the supervisor names the
    folder when a rank wrote something there, and removes it when no log holds anything beyond
    the line every rank starts its log with."""
    wrote = log.startswith("Traceback")
    logs = tmp_path / "megarl-convert-logs-x"
    logs.mkdir()
    (logs / "progress").write_text("3 10")  # rank 0's tensor count, not a log
    start = START_LINE.format(rank=0, pid=123, name="ImportRank") + "\n"
    (logs / "import_rank0.log").write_text(start if log == "start-line" else log)
    (logs / "import_rank1.log").write_text(start)
    code = supervise(_driver(f"s.report(rank_logs={str(logs)!r})\nos._exit(9)"), ray=False, kept="OUT is as it was")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert logs.exists() == wrote
    assert (f"; the ranks' logs: {logs}; OUT is as it was" in err[0]) == wrote, err[0]
    assert err[0].endswith("; OUT is as it was")


# Ray's core worker's line (its real words) when the raylet died as the driver registered, written at the C level.
RAY_CPP_LINE = ("[2026-11-29 19:51:17,280 E 14936 14936] core_worker_process.cc:247: Failed to register worker to Raylet: "
                "IOError: Failed to read data from the socket: End of file worker_id=01000000ffffffffffffffffffffffffffffffffff\n")  # fmt: skip
ABSL_BLOCK = "*** SIGABRT received at time=1795981500 on cpu 0 ***\nPC: @     0x7f9035ca3f16  (unknown)  abort\n"


@pytest.mark.parametrize("log", [True, False], ids=["driver-log-reported", "no-log-yet"])
def test_ray_s_c_level_lines_on_the_driver_s_stderr_go_to_its_log(capfd, tmp_path, log):
    """What Ray's C++ writes on the driver's stderr (no Python handler sees it) goes to the log file
    the driver reported, not before the supervisor's line; the driver's own stderr, partial lines
    included, passes in order; with no log reported yet, nothing is hidden."""
    driver_log = tmp_path / "driver.log"
    body = (f"s.report(log={str(driver_log)!r})\n" if log else "") + (
        "os.write(2, b'starting Ray ... ')\ntime.sleep(0.3)\nos.write(2, b'(6 s)\\n')\n"
        f"os.write(2, {RAY_CPP_LINE!r}.encode())\nos.write(2, {ABSL_BLOCK!r}.encode())\n"
        "sys.stderr.write('a warning of the driver\\n')\nsys.stderr.flush()\nos._exit(1)")  # fmt: skip
    code = supervise(_driver(body), ray=False, kept="OUT is as it was")
    err = capfd.readouterr().err
    assert code == 2
    assert err.startswith("starting Ray ... (6 s)\n") and "a warning of the driver\n" in err, err
    assert err.splitlines()[-1].startswith("error: the driver process"), err
    if log:
        assert "core_worker_process.cc" not in err and "SIGABRT" not in err and "PC: @" not in err, err
        assert driver_log.read_text() == RAY_CPP_LINE + ABSL_BLOCK
    else:
        assert "core_worker_process.cc:247: Failed to register worker" in err and "*** SIGABRT received" in err


# Ray's Python logger's lines on the driver's stderr (their real words and format, a tab before the level).
RAY_PY_LINE = "2026-11-29 20:33:14,340\tINFO node.py:438 -- Failed to get node info b'GCS cannot find the node with node ID 4f'\n"
RAY_STARTED = "2026-11-29 20:27:58,940\tINFO worker.py:2038 -- Started a local Ray instance.\n"
RAY_JOINED = "2026-11-29 20:27:58,940\tINFO worker.py:1832 -- Connected to Ray cluster. View the dashboard at 10.0.0.7:8265 \n"


def test_ray_s_python_logger_lines_go_to_the_log_but_the_cluster_it_joined(capfd, tmp_path):
    """Ray's Python logger's line after a raylet killed as Ray started (written in two pieces, as a
    long line may arrive) and its word that it started a local Ray (megarl's own line said so) go
    to the driver's log; the cluster it joined (its dashboard) stays on the terminal, and so does
    megarl's own log line."""
    driver_log = tmp_path / "driver.log"
    body = (f"s.report(log={str(driver_log)!r})\ntime.sleep(0.5)\nos.write(2, {RAY_STARTED!r}.encode())\n"
            f"os.write(2, {RAY_JOINED!r}.encode())\n"
            f"os.write(2, {RAY_PY_LINE[:30]!r}.encode())\ntime.sleep(0.05)\nos.write(2, {RAY_PY_LINE[30:]!r}.encode())\n"
            "os.write(2, b'20:33:15 INFO megarl.trainer.launch: starting\\n')\nos._exit(1)")  # fmt: skip
    code = supervise(_driver(body), ray=False, kept="OUT is as it was")
    err = capfd.readouterr().err
    assert code == 2
    assert "Failed to get node info" not in err and driver_log.read_text() == RAY_STARTED + RAY_PY_LINE, err
    assert err.startswith(RAY_JOINED + "20:33:15 INFO megarl.trainer.launch: starting\n"), err


def test_stdout_and_stderr_into_one_file_keep_their_order(tmp_path):
    """`megarl ... > log 2>&1` (a script, Slurm): the driver's stdout goes through the relay with
    its stderr, so alternating writes land in the order made, Ray's C++ line to the log reported."""
    driver_log, out = tmp_path / "driver.log", tmp_path / "out.txt"
    body = (f"s.report(log={str(driver_log)!r})\ntime.sleep(0.5)\n"  # (the supervisor reads the reports every 0.2 s)
            "for i in range(50):\n    print(f'out {i}', flush=True)\n    print(f'err {i}', file=sys.stderr, flush=True)\n"
            f"os.write(2, {RAY_CPP_LINE!r}.encode())\ns.report(end=0)")  # fmt: skip
    with out.open("w") as f:
        code = subprocess.run([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                               f"sys.exit(supervise({_driver(body)!r}, ray=False))"], stdout=f, stderr=subprocess.STDOUT,
                              timeout=120).returncode  # fmt: skip
    assert code == 0
    assert out.read_text().splitlines() == [f"{kind} {i}" for i in range(50) for kind in ("out", "err")]
    assert driver_log.read_text() == RAY_CPP_LINE


# A leftover outside the sweep (no tag: a fresh environment) that holds the driver's stderr for 8 s,
# longer than the supervisor waits for it (JOIN_TIMEOUT_S).
HOLDS_STDERR = "import subprocess\nsubprocess.Popen(['env', '-i', 'sh', '-c', 'sleep 8'])\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("ending", ["os._exit(1)", "s.report(end=0)\nos._exit(0)"], ids=["silent-end", "reported-end"])
def test_a_stop_while_the_supervisor_cleans_up_is_no_traceback(tmp_path, signum, ending):
    """The driver ended; the supervisor waits for what still holds its stderr (up to seconds) when
    a Ctrl-C or SIGTERM comes: no traceback, no silent death; the line and 128 + N after a silent
    end, the driver's own exit code after a reported one."""
    done = tmp_path / "done"
    body = HOLDS_STDERR + f"open({str(done)!r}, 'w').write(str(os.getpid()))\n" + ending
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                             f"sys.exit(supervise({_driver(body)!r}, ray=False))"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    for _ in range(600):
        if done.exists() and done.read_text():
            break
        time.sleep(0.1)
    driver = Path(f"/proc/{done.read_text()}")
    for _ in range(600):  # reaped by the supervisor, which then waits on the relay (up to JOIN_TIMEOUT_S)
        if not driver.exists():
            break
        time.sleep(0.05)
    proc.send_signal(signum)
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    if ending == "os._exit(1)":
        assert code == 128 + signum
        assert len(err.splitlines()) == 1 and err.startswith("error: the driver process"), err
    else:
        assert code == 0 and err == ""


@pytest.mark.parametrize("partial", ["  50%|###       | 5/10\r", "Password: ", "[2026-11-29 19:5"], ids=["progress", "prompt", "ray-like"])
def test_a_partial_line_reaches_the_terminal_without_its_end(tmp_path, partial):
    """A prompt or a progress bar's \\r update is passed on as written; one that might become
    Ray's line (it fits its start so far) too, once nothing more came for a moment."""
    seen = tmp_path / "seen"
    body = (f"os.write(2, {partial!r}.encode())\n"
            f"for _ in range(300):\n    if os.path.exists({str(seen)!r}): break\n    time.sleep(0.1)\n"
            "s.report(end=0)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from megarl.driver_supervisor import supervise; "
                             f"sys.exit(supervise({_driver(body)!r}, ray=False))"], stderr=subprocess.PIPE)  # fmt: skip
    got = b""
    try:
        while len(got) < len(partial.encode()) and select.select([proc.stderr], [], [], 20)[0]:
            got += os.read(proc.stderr.fileno(), 4096)
        seen.touch()  # the driver may go on
        assert got == partial.encode()
        assert proc.wait(timeout=60) == 0
    finally:
        seen.touch()
        proc.kill()
        proc.wait()


def test_what_may_become_ray_s_line_is_what_fits_its_start():
    assert may_become_ray(b"[") and may_become_ray(b"[2026-11-29 19:51:17,280 E 1") and may_become_ray(b"*** SIGAB")
    assert may_become_ray(b"PC: @   ") and may_become_ray(b"    @ 0x7f") and may_become_ray(b"2026-11-29 20:33:14,3")
    assert not may_become_ray(b"20:33:15 INFO megarl")
    assert not may_become_ray(b"[INFO] loading") and not may_become_ray(b"[2026-11-29 19:51:17,280 X")
    assert not may_become_ray(b"  50%|###") and not may_become_ray(b"Password: ") and not may_become_ray(b"*** done")


def test_a_leftover_that_keeps_writing_comes_not_after_the_line(tmp_path):
    """A process outside the sweep (no tag) that holds the driver's stderr and keeps writing: after
    the relay's wait (1 s here) the relay stops, so the supervisor's line is the last."""
    pid_file = tmp_path / "leftover.pid"
    writer = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\nend = time.time() + 20\n"
              "while time.time() < end:\n    os.write(2, b'leftover\\n')\n    time.sleep(0.002)")  # fmt: skip
    body = (f"import subprocess\nsubprocess.Popen(['env', '-i', sys.executable, '-c', {writer!r}, {str(pid_file)!r}])\n"
            f"while not (os.path.exists({str(pid_file)!r}) and os.path.getsize({str(pid_file)!r})): time.sleep(0.05)\n"
            "time.sleep(0.2)\nos._exit(1)")  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; import megarl.driver_stderr as d; d.JOIN_TIMEOUT_S = 1.0\n"
                               "from megarl.driver_supervisor import supervise\n"
                               f"sys.exit(supervise({_driver(body)!r}, ray=False))"], capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        if pid_file.exists() and pid_file.read_text():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and "leftover" in lines, proc.stderr[-500:]
    assert lines[-1].startswith("error: the driver process"), lines[-5:]


def test_a_driver_that_ends_itself_leaves_no_untagged_ray_agent_behind(tmp_path):
    # Ray's agents carry no tag: only the driver's reaper ends them. The reaper carried the tag, and
    # the supervisor's sweep ended it before (or between its SIGSTOP and its SIGKILL: agents left
    # stopped for good) it could.
    pid_file = tmp_path / "agent.pid"
    body = ("from megarl.ray_cluster.session import start_reaper\nimport subprocess\nreaper = start_reaper()\n"
            "agent = subprocess.Popen(['env', '-i', 'sleep', '120'])\n"  # a stand-in for an agent: no tag
            f"open({str(pid_file)!r}, 'w').write(str(agent.pid))\ntime.sleep(1.5)\nos._exit(1)")  # (seen by the reaper's scans)
    assert supervise(_driver(body), ray=False) == 2
    agent = Path(f"/proc/{pid_file.read_text()}")
    for _ in range(600):
        if not agent.exists():
            break
        time.sleep(0.05)
    assert not agent.exists(), (agent / "status").read_text()


def test_the_reaper_carries_no_tag(monkeypatch):
    # so that the sweep (end_tagged) never cuts its freeze-then-kill of Ray's untagged agents short
    from megarl.ray_cluster.session import start_reaper, stop_reaper
    from megarl.tagged_processes import tagged

    tag = new_tag()
    monkeypatch.setenv(DRIVER_TAG_ENV, tag)
    reaper = start_reaper()
    assert reaper is not None
    try:
        assert reaper.pid not in tagged(tag)
    finally:
        stop_reaper(reaper)


def test_a_driver_that_stopped_itself_is_continued_by_the_users_stop(tmp_path):
    # User code in the driver that sends it SIGSTOP: the user's Ctrl-C / SIGTERM, passed on, did
    # nothing while it stayed stopped (the signal waits for a SIGCONT).
    import threading

    ready = tmp_path / "stopping"
    body = (f"signal.signal(signal.SIGTERM, lambda *a: (s.report(end=143), os._exit(143)))\n"
            f"open({str(ready)!r}, 'w').close()\nos.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(120)\nos._exit(0)")  # fmt: skip

    def stop_once_stopped() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # (the driver stops itself just after)
        os.kill(os.getpid(), signal.SIGTERM)  # the user's stop, to the supervisor (this process)

    sender = threading.Thread(target=stop_once_stopped, daemon=True)
    sender.start()
    assert supervise(_driver(body), ray=False) == 143
    sender.join(timeout=10)
