"""`megarl launch` watched from outside: the driver runs as a child of the command's process (as
every command's whose driver starts Ray: megarl/commands/supervision.py).

Ray's core worker ends a driver whose raylet is gone at the C level (a quick exit: no Python
handler, no ``finally``, only Ray's state dump on stderr), and Ray has no setting that keeps the
driver alive instead; user code in the driver (a generate function, tool or dataset class) may
call ``os._exit`` as well, under ``--in-process`` too. So the process the user started only
supervises: it starts the driver (the same command line) as its child, with a pipe on which the
driver reports what it knows (the resume command, its log, its Ray node and raylet) and, last,
that it ended on its own. A child that ends without that last report was ended from outside
Python, and the supervisor prints the one ``error:`` line the driver could not. Which one
depends on what died first: the supervisor watches the raylet while the driver runs, since an
embedded raylet dies with its driver (Ray's fate sharing) and a dead raylet found afterwards
says nothing. The node's line (where its raylet's logs are) needs positive evidence: an ending
Ray gives a driver for its raylet (its quick exit, exit code 1) and either a raylet seen dead
while the driver lived or Ray's log of the driver ending in its raylet's loss (Ray often ends
the driver within a moment). Else, and always for another exit code (user code's
``os._exit(0)``) or a signal from outside (a ``kill -9``), the driver's own death (its exit code
or signal, the likely causes, its log): a driver that ends on its own takes its raylet with it,
and that raylet may be seen dead before the driver can be reaped.
Both end with the command that resumes.
A raylet that dies inside the driver's ray.init (between its reports that ray.init begins and
that it ended) leaves the driver waiting 30 s in Ray's C code for the node: the supervisor ends
it after START_GRACE_S with the line the driver would have given (but waits for a driver it
passed a stop on to: its ray.shutdown, which ended the raylet, takes its time, and its own line
says it stopped). Past ray.init the driver is waited for, however long it takes: Ray ends it, or
it gives its own line.

Signals: the driver runs in a process group of its own, so every stop signal reaches it once,
from the supervisor, however it was sent: a terminal's Ctrl-C (which reaches the foreground
group: the supervisor's), `kill -INT <pid of megarl launch>` from a script or an orchestrator, a
signal to the command's process group. SIGINT, SIGTERM, SIGHUP, SIGQUIT (Ctrl-\\, which stops
at once) and every other signal whose default would end a process without a word (SIGALRM,
SIGXCPU, the real-time signals: megarl/signal_kinds.py) are forwarded; a second Ctrl-C stays a
second one (it stops at once). A driver such a stop killed before its handlers were up ends the
start-up with one line: ``stopped by <signal> while starting``, exit code 128 + its number. The
driver dies with the supervisor (PR_SET_PDEATHSIG, SIGKILL: a `kill -9` of `megarl launch` ends
the run at once, as it did when that process was the driver; the embedded Ray's reaper then ends
the rest).

Leftovers: however the driver ended, the supervisor then ends every process that still carries
the driver's tag (megarl/tagged_processes.py) before it exits: Ray's workers whose raylet was
killed live on, re-parented, for 20-40 s, out of reach of the driver's teardown and its reaper.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megarl.driver_stderr import StderrRelay
from megarl.signal_kinds import OUTSIDE_STOPS, STACKS_SIGNALS, STOPS, signal_name, unclaimed
from megarl.stop_origin import StopWitnesses, drain, take_witnesses
from megarl.tagged_processes import DRIVER_TAG_ENV, end_tagged, new_tag

SUPERVISOR_FD_ENV = "MEGARL_SUPERVISOR_FD"  # the driver's end of the pipe (set for the child only)
# The output locks the supervisor holds for its driver (megarl/trainer/run_lock.py: device:inode of
# each lock file, comma-separated; set for the child only, and forgotten there as the pipe is)
SUPERVISOR_HOLDS_ENV = "MEGARL_SUPERVISOR_HOLDS"
# Every stop is forwarded (megarl/signal_kinds.py): SIGQUIT (Ctrl-\) too, on which the driver stops
# at once, and OUTSIDE_STOPS (SIGALRM, SIGXCPU, every real-time signal, the watchdog's SIGRTMIN+4
# too, ...), on which it stops as on SIGTERM: Python's default would end this process with no line, the driver then killed with it.
# `kill -USR1 <megarl>` (or -USR2, STACKS_SIGNALS): the driver writes every thread's Python stack to
# its stderr and goes on (as the ranks write theirs to their logs on it); passed on, never a stop.
_SHOWN: dict[int, str] = {signal.SIGQUIT: "SIGQUIT (Ctrl-\\)"}  # how a stop names its signal where the name alone says too little
USER_CODE = "a generate function, tool, interaction or dataset class"  # what a driver may run of the user's
RAY_REPORTS_LOG = "ray_reports.log"  # Ray's reports beside a command's ranks' logs, for one without a driver.log (convert)
WATCH_INTERVAL_S = 0.2  # how often the supervisor looks at the raylet (one /proc read): to see it die before its driver
START_GRACE_S = 5.0  # a driver whose raylet died inside ray.init and that has not ended after this is ended
_report_fd: int | None = None
_supervisor_pid: int | None = None
_supervisor_holds: frozenset[str] = frozenset()


def take_report_pipe() -> None:
    """At the start of a command: a supervisor's pipe, if any, becomes this process's (the
    environment variable is forgotten, so processes this one starts do not write on it)."""
    global _report_fd, _supervisor_pid, _supervisor_holds
    fd = os.environ.pop(SUPERVISOR_FD_ENV, None)
    holds = os.environ.pop(SUPERVISOR_HOLDS_ENV, "")
    if fd is not None and fd.isdigit():
        _report_fd, _supervisor_pid = int(fd), os.getppid()
        _supervisor_holds = frozenset(claim for claim in holds.split(",") if claim)
        os.set_inheritable(_report_fd, False)
    take_witnesses()  # where its stops come from (megarl/stop_origin.py)


def supervised() -> bool:
    """Whether this process is a driver under a supervisor."""
    return _report_fd is not None


def supervisor_holds() -> frozenset[str]:
    """The output locks this driver's supervisor holds for it (claims: device:inode of each lock
    file; none without a supervisor)."""
    return _supervisor_holds


def command_pid() -> int:
    """The pid of the command the user started (the supervisor's, for a supervised driver): the
    one to name in messages (a lock's holder), which a SIGTERM stops cleanly."""
    return _supervisor_pid or os.getpid()


def report(**fields: Any) -> None:
    """Tell the supervisor something (one JSON line; nothing without a supervisor). ``end=code``
    is the driver's own ending."""
    if _report_fd is None:
        return
    try:
        os.write(_report_fd, (json.dumps(fields) + "\n").encode())
    except OSError:  # a supervisor that is gone: nobody to tell
        pass


def report_ray_starting() -> None:
    """Just before ray.init: a raylet that dies from here until :func:`report_ray_node` leaves the
    driver waiting in Ray's C code (START_GRACE_S), and only then."""
    report(ray_starting=True)


def report_ray_node() -> None:
    """Ray started: the node this driver runs on and its log folder, for the supervisor's line
    when the node's raylet takes the driver down with it. The end of ray.init is reported even
    when the node cannot be described: past it, a raylet's death is the running node's."""
    if _report_fd is None:
        return
    node: dict[str, Any] = {}
    try:
        import ray

        worker_node = ray._private.worker.global_worker.node
        raylets = worker_node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET) or []  # an embedded Ray's
        node = {"ip": worker_node.node_ip_address, "node_id": ray.get_runtime_context().get_node_id(),
                "logs": worker_node.get_logs_dir_path(), "raylet": f"{worker_node.node_ip_address}:{worker_node.node_manager_port}",
                "raylet_pid": raylets[0].process.pid if raylets else None}  # fmt: skip
    except Exception:  # noqa: BLE001 - another Ray's internals: the supervisor then says less
        pass
    report(ray_starting=False, **({"ray": node} if node else {}))


def supervise(command: Sequence[str], *, ray: bool = True, kept: str | None = None,
              user_code: str | None = USER_CODE, env_extra: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """Run ``command`` (a driver) as a child; its exit code, or, when it ended without reporting
    its end, one ``error:`` line and exit code 2 (130 after a Ctrl-C; 128 + N for a stop signal N
    that came after the driver had ended, while its leftovers were ended: a driver's reported
    exit code stands then). ``ray``: whether the
    driver starts Ray (not for ``--in-process``), for that line; ``kept``: what that line says is
    left, for a command that has no resume command to report; ``user_code``: the user code the
    driver runs, named as a likely cause (None: it runs none) (megarl/commands/supervision.py);
    ``env_extra``: more of the driver's environment (what this process holds for it)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    stops = _Stops(StopWitnesses(user_code))  # which stops the driver gets are the user's (megarl/stop_origin.py)
    # The handlers stay up until the end: a stop while the leftovers are ended and the relay drains
    # would otherwise raise KeyboardInterrupt there (a traceback, no line) or kill this process silently.
    previous = {s: signal.signal(s, stops.on_signal) for s in (*STOPS, *unclaimed(OUTSIDE_STOPS))}
    previous |= {s: signal.signal(s, stops.pass_stacks_request) for s in STACKS_SIGNALS}
    tag = new_tag()  # what every process the driver starts inherits: they are ended with it
    relay = StderrRelay()  # the driver's stderr, less Ray's C++ lines (megarl/driver_stderr.py)
    stdout, stderr = relay.child_streams()
    child: subprocess.Popen[bytes] | None = None
    try:
        env = {**os.environ, **(env_extra or {}), SUPERVISOR_FD_ENV: str(write_end), DRIVER_TAG_ENV: tag,
               **stops.witnesses.driver_env()}  # fmt: skip
        dies_with_this = functools.partial(_die_with_parent, os.getpid())
        child = stops.child = subprocess.Popen(
            list(command), env=env, pass_fds=(write_end, *stops.witnesses.driver_fds()),
            stdout=stdout, stderr=stderr, preexec_fn=dies_with_this, process_group=0)  # fmt: skip
        os.close(write_end)
        stops.witnesses.driver_started(child.pid, (*STOPS, *OUTSIDE_STOPS), dies_with_this)
        relay.start()
        for signum in stops.pending:
            stops.send(signum)
        code, data, raylet_first, found = _watch(child, read_end, ray=ray, relay=relay, stops=stops)
        end_tagged(tag)  # what outlived the driver (Ray's workers re-parented when their raylet died) ends with it
        relay.finish()  # all the driver wrote, before this process's own line
        reports = _parse_reports(data + drain(read_end))
        if found and "ray" not in reports:  # the raylet died as Ray started, before the driver could say where
            reports["ray"] = found
        if ended_by_ray(code):  # any other ending is the driver's own, whatever Ray logged
            raylet_first = raylet_first or _ray_saw_its_raylet_die(reports.get("ray"), child.pid)
        if "end" in reports:  # the driver's own exit code stands, whatever its teardown (or a stop during the sweep) did after
            return _reported_end(reports["end"], code)
        _keep_rank_logs_that_say_something(reports)
        if found and found.get("stuck_in_start"):  # the line the driver would have given 30 s later
            _say(f"error: {raylet_died_as_ray_started(found['raylet_pid'], 'died', found.get('logs'))}")
            return 128 + stops.late[0] if stops.late else 130 if stops.interrupted else 2
        if code < 0 and (-code in stops.passed_on or (-code == signal.SIGINT and stops.interrupted)):  # before its handlers were up
            _say(f"stopped by {_SHOWN.get(-code) or signal_name(-code)} while starting; {kept or 'nothing was trained or saved'}")
            return 128 - code
        _say(silent_end_line(code, reports, child.pid, raylet_first=raylet_first, ray=ray, kept=kept, user_code=user_code))
        return 128 + stops.late[0] if stops.late else 130 if stops.interrupted else 2
    except BaseException:  # this process's own failure: the driver ends with it, not after what this process held
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
            end_tagged(tag)
        raise
    finally:
        os.close(read_end)
        stops.witnesses.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Stops:
    """The stop signals a supervisor received: each is passed on to the driver once (``pending``
    until it is there); one that came after the driver had ended is ``late``, this process's own."""

    def __init__(self, witnesses: StopWitnesses) -> None:
        self.witnesses = witnesses
        self.child: subprocess.Popen[bytes] | None = None
        self.interrupted = False
        self.pending: list[int] = []
        self.passed_on: set[int] = set()
        self.late: list[int] = []

    def send(self, signum: int) -> None:
        assert self.child is not None
        self.witnesses.announce(signum)  # before the signal: the driver's handler finds it there
        self.child.send_signal(signum)
        # a driver stopped (SIGSTOP from user code in it, a `kill -STOP`) would take the stop only once
        # continued: the user's stop continues it
        self.child.send_signal(signal.SIGCONT)

    def pass_stacks_request(self, signum: int, frame: Any) -> None:
        """SIGUSR1: the driver writes its Python stacks (megarl/cli.py); no stop, nothing recorded."""
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupted = True
        if self.child is None:
            self.pending.append(signum)
        elif self.child.poll() is None:
            self.send(signum)
        else:
            self.late.append(signum)
        self.passed_on.add(signum)


def _watch(child: subprocess.Popen[bytes], fd: int, *, ray: bool = True, relay: StderrRelay | None = None,
           stops: _Stops | None = None) -> tuple[int, bytes, bool, dict[str, Any] | None]:  # fmt: skip
    """Wait for the driver, watching the raylet it reported (a local pid), or, with ``ray``, the
    one found among its children before it could report (Ray starts an embedded raylet as the
    driver's child; its children are looked at only until the driver's ``ray`` report, which
    names no pid for a cluster's raylet, attached to with ``--address``): its exit code, what it wrote, whether the raylet was seen dead while the
    driver still lived and the driver then ended as Ray ends one for its raylet (exit code 1),
    and the raylet found so (``stuck_in_start`` when it died inside ray.init and the driver had
    to be ended); ``relay`` learns the log file the driver reports; ``stops``: the
    stops passed on to the driver (one that stops does not get the raylet's verdict). The order is the cause: an embedded raylet dies with its driver
    (Ray's fate sharing), so a raylet found dead after the driver says nothing, and Ray ends a
    driver only after its raylet is gone."""
    data = b""
    reports: dict[str, Any] = {}
    raylet_pid: int | None = None
    found: dict[str, Any] | None = None
    while True:
        try:
            return child.wait(timeout=WATCH_INTERVAL_S), data, False, found
        except subprocess.TimeoutExpired:
            pass
        chunk = drain(fd)
        data += chunk
        if chunk:  # every report is read as it comes, the ``ray`` one too after the raylet was found
            reports = _parse_reports(data)
            if relay is not None:
                relay.log_file = ray_lines_file(reports)
        if raylet_pid is None:  # still looking: a cluster's raylet (--address) is not the driver's child
            if "ray" in reports:
                raylet_pid = reports["ray"].get("raylet_pid")
            elif ray:  # until the driver's report: Ray starts an embedded raylet as its child
                found = raylet_child(child.pid)
                raylet_pid = found["raylet_pid"] if found else None
        if raylet_pid is not None and not _alive(raylet_pid):
            # Seen dead first is not enough: a driver that ends on its own (user code's os._exit,
            # a kill) takes its raylet with it, which may be seen dead before the driver is
            # reapable (its children get their parent-death signal before it becomes a zombie).
            # Only an ending that Ray gives a driver for its raylet confirms the order.
            if child.poll() is not None:
                return child.returncode, data, False, found
            data += drain(fd)  # the driver's last reports: whether it was still inside ray.init
            if found is not None and _parse_reports(data).get("ray_starting"):
                found["stuck_in_start"] = _stuck_in_start(child, stops)
            code = child.wait()
            return code, data, ended_by_ray(code), found


def _stuck_in_start(child: subprocess.Popen[bytes], stops: _Stops | None = None) -> bool:
    """Whether the driver, whose raylet died inside its ray.init, had to be ended (SIGKILL): Ray's
    start waits 30 s for the node (in Ray's C code, where no Python handler or thread of the
    driver's can end it); a driver Ray ends at once (its quick exit) or that gets control back
    (its own line) ends within START_GRACE_S. A driver a stop was passed on to is waited for: its
    ray.shutdown ends the raylet first (the death seen here) and then waits about a second for
    each of Ray's other processes, so it may need longer, and its own line (``stopped by SIGINT
    ... while starting``) is the one that says what happened."""
    try:
        child.wait(timeout=START_GRACE_S)
        return False
    except subprocess.TimeoutExpired:
        if stops is not None and stops.passed_on:
            child.wait()
            return False
        child.kill()
        return True


def ray_lines_file(reports: dict[str, Any]) -> str | None:
    """Where Ray's C++ lines on the driver's stderr go: the driver's log (launch, sft), else a file
    beside the ranks' logs (convert's, whose own ray_reports.log it is), else None (the terminal)."""
    if reports.get("log"):
        return str(reports["log"])
    return os.path.join(reports["rank_logs"], RAY_REPORTS_LOG) if reports.get("rank_logs") else None


def _reported_end(end: Any, code: int) -> int:
    """The exit code a driver reported as its end; where it reported none (an exception on its way
    out, ``sys.exit(None)`` or a message), its process's (``code``, a signal as 128 + N)."""
    if isinstance(end, int) and not isinstance(end, bool):
        return end
    return code if code >= 0 else 128 - code


def _keep_rank_logs_that_say_something(reports: dict[str, Any]) -> None:
    """The folder of rank logs a driver reported (``rank_logs``: `megarl convert`'s, in /tmp) and
    could not clean up as it does when it ends on its own: removed when no ``*.log`` in it holds
    anything beyond the ranks' own start lines (its ``rank_logs`` report dropped then), else
    kept, for the line to name."""
    import glob
    import shutil

    from megarl.rank_logs import says_something

    folder = reports.get("rank_logs")
    if not folder:
        return
    if not any(says_something(path) for path in glob.glob(os.path.join(glob.escape(folder), "*.log"))):
        shutil.rmtree(folder, ignore_errors=True)
        reports.pop("rank_logs")


def raylet_child(pid: int) -> dict[str, Any] | None:
    """An embedded raylet among process ``pid``'s children (/proc: its name, and what its command
    line says of its node: address, id, session folder), as the driver reports its node; None
    when there is none (not started yet, a cluster's, not Linux)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = f.read().split()
        except OSError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/comm") as f:
                    if f.read().strip() != "raylet":
                        continue
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    args = dict(a.partition("=")[::2] for a in f.read().decode(errors="replace").split("\0") if a.startswith("--"))
            except OSError:
                continue
            # <session>/sockets/raylet; a raylet already dead (a zombie) has no command line left: the GCS's names it
            session = os.path.dirname(os.path.dirname(args.get("--raylet_socket_name", ""))) or session_dir(children)
            return {"ip": args.get("--node_ip_address", "?"), "node_id": args.get("--node_id", "?"),
                    "logs": os.path.join(session, "logs") if session else None, "raylet_pid": int(child)}  # fmt: skip
    return None


def session_dir(pids: Iterable[int | str]) -> str:
    """The Ray session folder one of ``pids`` names on its command line (the GCS's, an agent's:
    ``--session-dir=``; a dead raylet's says nothing), or "" (megarl/ray_cluster/session.py's too)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            name, _, value = arg.partition("=")
            if name in ("--session-dir", "--session_dir") and value:
                return value
    return ""


RAY_QUICK_EXIT_CODE = 1  # Ray's QuickExit(), which ends a driver whose raylet is gone: _Exit(1)


def ended_by_ray(code: int) -> bool:
    """Whether exit code ``code`` is one Ray ends its driver with: its quick exit for a lost
    raylet (exit code 1), or a failed check in its C code (an abort, a crash). Any other (user
    code's ``os._exit(0)`` or ``os._exit(9)``, a kill from outside) is the driver's own death."""
    return code == RAY_QUICK_EXIT_CODE or (code < 0 and -code in (signal.SIGABRT, signal.SIGSEGV))


# What the driver's core worker logs just before it ends the process for a dead raylet (Ray 2.x):
# it often notices within a moment, before the supervisor's next look at the raylet.
# "Failed to register worker": the raylet died as Ray started, before the driver could connect.
RAYLET_LOST = ("The connection to the plasma store is failed", "the local Raylet is dead",
               "Terminating the worker due to local raylet death", "because the local raylet failed",
               "Failed to register worker to Raylet")  # fmt: skip


def _ray_saw_its_raylet_die(node: dict[str, Any] | None, pid: int) -> bool:
    """Whether Ray's own log of the driver (<logs>/python-core-driver-*_<pid>.log) ends in its
    raylet's loss."""
    import glob

    if not node or not node.get("logs"):
        return False
    for path in glob.glob(os.path.join(glob.escape(node["logs"]), f"python-core-driver-*_{pid}.log")):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
                tail = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(line in tail for line in RAYLET_LOST):
            return True
    return False


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _die_with_parent(parent: int) -> None:
    """In a child before its exec: it is killed when ``parent`` (the supervisor) ends, and at once
    when that happened between the fork and now (no death signal would come then)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the driver dies with the supervisor
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _parse_reports(data: bytes) -> dict[str, Any]:
    """The child's JSON lines, later reports winning (a partial last line is skipped)."""
    reports: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            reports.update(json.loads(line))
        except (ValueError, TypeError):
            continue
    return reports


def raylet_died_as_ray_started(pid: int, how: str, logs: str | None, when: str = "as Ray started") -> str:
    """The one line for an embedded raylet (``pid``) that ended (``how``) while Ray started, found
    during ray.init or just after it (or ``when`` else); ``logs``: its session's log folder, when
    known. The driver's (megarl/ray_cluster/session.py) and, for a driver stuck in ray.init, its
    supervisor's."""
    # Not session_latest: on a machine other Ray runs share, that link is whichever started last.
    where = (f"{os.path.join(logs, 'raylet.out')} and raylet.err" if logs else
             "in this run's session folder under /tmp/ray (its logs/raylet.out and raylet.err; not session_latest "
             "when other Ray runs share the machine)")  # fmt: skip
    return (f"the Ray node under the run died {when}: its raylet (pid {pid}) {how}; check this machine "
            f"(killed processes, memory: dmesg) and the raylet's logs {where}, then run the same command again")


def silent_end_line(code: int, reports: dict[str, Any], pid: int, *, raylet_first: bool = False, ray: bool = True,
                    kept: str | None = None, user_code: str | None = USER_CODE) -> str:  # fmt: skip
    """The ``error:`` line of a driver that ended without a word of its own: the Ray node's death
    when its raylet went first (seen dead while the driver lived, or, for a raylet the supervisor
    could not watch, one that no longer answers), else the driver's own death. It ends with the
    command that resumes (reported by the driver), else with what is ``kept`` (a command's own)."""
    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    resume = f"; resume with: {reports['resume']}" if reports.get("resume") else f"; {kept}" if kept else ""
    if reports.get("rank_logs"):  # kept by the supervisor only when a rank wrote something there
        resume = f"; the ranks' logs: {reports['rank_logs']}{resume}"
    node = reports.get("ray")
    silent = None
    if node and not raylet_first and not node.get("raylet_pid") and node.get("raylet"):
        silent = _unanswered(node["raylet"])  # a cluster's raylet: not this driver's child, it outlives it
    if node and (raylet_first or silent):
        logs = node.get("logs") or "the Ray session's logs folder"
        raylet = f"its raylet does not answer ({silent})" if silent else "its raylet died first"
        return (f"error: the Ray node under the run died: node {node.get('ip', '?')} (id {str(node.get('node_id', '?'))[:12]}); "
                f"the driver process (pid {pid}) {how} ({raylet}); check that machine (killed processes, memory: dmesg) "
                f"and the raylet's logs {os.path.join(logs, 'raylet.out')} and raylet.err{resume}")  # fmt: skip
    when = " before Ray started" if ray and not node else ""
    # A command with no log file of its own (convert, generate) has its output on the terminal only.
    log = reports.get("log")  # named once it exists: a driver killed in its checks has written none
    log = f"the driver's log: {log}" if log and os.path.exists(log) else "its output is above"
    user_code = reports.get("user_code") or user_code  # what the driver said it was running, when it did
    causes = (f"user code in the driver ({user_code}) calling os._exit, a kill from outside, or the OOM killer" if user_code
              else "a kill from outside or the OOM killer (the command runs none of your code)")  # fmt: skip
    return f"error: the driver process (pid {pid}) {how} without reporting an error{when}: {causes} (check dmesg); {log}{resume}"


def _unanswered(address: str) -> str | None:
    """Why nothing listens at host:port (one TCP connect), or None when something does."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return None
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # a terminal that hung up
        pass
