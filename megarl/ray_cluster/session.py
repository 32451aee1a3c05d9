"""Start or attach to Ray for one run, and write Ray's timeline on request.

`ray_session()` starts an embedded local Ray (no dashboard) when no address is given, or
attaches to a running cluster ("auto" or host:port); on exit it shuts down only what it
started (an already initialised Ray, e.g. a test fixture's, is reused and left running).

An embedded Ray's processes (GCS, raylet, agents, workers) and the driver's other children
(reward workers) are children of the driver. Ray's processes block SIGTERM and SIGHUP, as they block SIGINT:
a stop signal sent to the whole process group reaches the driver, which saves, and not the
workers holding the run's state. When the driver is killed without a chance to
clean up (SIGKILL, the OOM killer), a small reaper process, in its own session so that a
process-group kill spares it, notices at once (its stdin pipe from the driver closes), freezes
and kills every process of that run, then exits; a normal exit tells it to go quietly. Ray's
token-authentication notice is not printed for an embedded cluster (it stays on, local).
`save_timeline()` writes Ray's task/actor timeline (Chrome trace JSON, open it in
chrome://tracing or Perfetto) for profiling a run. Left out: starting multi-node clusters
(launch/ holds the Slurm / head-worker bootstrap), runtime environments beyond env vars.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from megarl.driver_supervisor import (
    raylet_died_as_ray_started,
    report_ray_node,
    report_ray_starting,
    session_dir,
)
from megarl.process_signals import stop_signals_blocked_in_children
from megarl.progress import still_waiting
from megarl.ray_cluster.raylet_report import raylet_reports_to_log
from megarl.signal_kinds import signal_name
from megarl.tagged_processes import DRIVER_TAG_ENV
from megarl.terminal import LOG_LEVEL_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaySession:
    """What the session is connected to."""

    address: str  # the GCS address of the cluster
    started_here: bool  # True: embedded Ray that this session shuts down
    resources: dict[str, float] = field(default_factory=dict)  # cluster totals at start


@contextmanager
def ray_session(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    log_to_driver: bool = True,
    namespace: str = "megarl",
    env_vars: Mapping[str, str] | None = None,
    ray_reports: Path | None = None,
) -> Iterator[RaySession]:
    """Ray for the duration of the `with` block.

    address None starts a local Ray with num_cpus / num_gpus (None: what the machine has);
    "auto" or "host:port" attaches to a cluster (num_cpus / num_gpus must then be None: the
    cluster's nodes declare their resources). env_vars reach every worker process.
    ray_reports: where Ray's report of a dead raylet goes for a command without a log file of its
    own (megarl/ray_cluster/raylet_report.py); never the terminal.
    """
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise ValueError(
            f"ray_session: num_cpus/num_gpus only apply to a local Ray; with address={address!r} "
            "the cluster's nodes declare their resources (start them with `ray start --num-cpus ...`)"
        )
    if ray.is_initialized():
        log.info("ray_session: reusing the Ray instance already initialised in this process")
        yield _describe(started_here=False)
        return
    report_ray_starting()  # until report_ray_node, a raylet's death leaves this process stuck in ray.init (its supervisor ends it)
    _start_or_attach(address, num_cpus=num_cpus, num_gpus=num_gpus, log_to_driver=log_to_driver, namespace=namespace,
                     env_vars=env_vars)  # fmt: skip
    reaper = None
    report_ray_node()  # Ray is up, and where the supervisor finds the raylet's logs
    try:
        if address is None:
            reaper = start_reaper()
            _refuse_a_dead_raylet()  # before the run imports any user code: a dead node is not that code's fault
        with raylet_reports_to_log(ray_reports):  # megarl's own line says a node died: Ray's 45 lines go to the log
            yield _describe(started_here=True)
    finally:
        if address is None:
            _shutdown_embedded()
        else:
            ray.shutdown()
        if reaper is not None:
            stop_reaper(reaper)


def _start_or_attach(address: str | None, *, num_cpus: int | None, num_gpus: int | None, log_to_driver: bool,
                     namespace: str, env_vars: Mapping[str, str] | None) -> None:  # fmt: skip
    """ray.init: a new local Ray (address None) or the cluster at ``address``, with ``env_vars``
    (and megarl's log level) in every worker's environment; ConnectionError naming the address
    when no cluster answers there."""
    if LOG_LEVEL_ENV in os.environ:  # megarl --log-level: the workers' too (megarl/terminal.py)
        env_vars = {LOG_LEVEL_ENV: os.environ[LOG_LEVEL_ENV], **(env_vars or {})}
    runtime_env = {"env_vars": dict(env_vars)} if env_vars else None
    kwargs = dict(log_to_driver=log_to_driver, namespace=namespace, runtime_env=runtime_env)
    if address is None:
        # "local" always starts a new instance; plain ray.init() would join a cluster found
        # through RAY_ADDRESS or a `ray start` on this machine (someone else's, on a shared box).
        with _quiet_auth_notice(), stop_signals_blocked_in_children():
            _init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, **kwargs)
    else:
        try:
            _probe(address)  # ray.init would retry a dead address for minutes
            _init(address=address, **kwargs)
        except ConnectionError as exc:
            raise ConnectionError(
                f"--address / cluster.ray_address {address!r}: no Ray cluster answered ({exc}). Start one with "
                "`ray start --head` (or the launch/ scripts), or unset cluster.ray_address to run "
                "an embedded local Ray"
            ) from exc


def _refuse_a_dead_raylet() -> None:
    """ConnectionError naming the node when the embedded raylet already ended (killed right after
    Ray started: the driver would go on importing user code, and its later death read as that code's)."""
    raylet = _embedded_raylet()
    problem = raylet_end_problem(*raylet) if raylet is not None else None
    if problem is not None:
        raise ConnectionError(problem)


def _embedded_raylet() -> tuple[subprocess.Popen[Any], str | None] | None:
    """This driver's embedded raylet (its process, a child of this one) and its session's log
    folder; None when attached to a cluster (its raylets are not this process's) or without Ray."""
    try:
        node = ray._private.worker.global_worker.node
        raylets = node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET) or []
        return (raylets[0].process, node.get_logs_dir_path()) if raylets else None
    except Exception:  # noqa: BLE001 - another Ray's internals (or none started): nothing to check
        return None


def embedded_node_death(when: str = "while the ranks started") -> str | None:
    """The one line for the embedded raylet's death, or None while it runs (or for a cluster's
    raylet). For the waits that nothing else ends when the raylet is gone: ranks that never
    start (Ray keeps their actors pending; the driver's core worker may not notice the loss)."""
    raylet = _embedded_raylet()
    return raylet_end_problem(*raylet, when=when) if raylet is not None else None


NODE_CHECK_S = 5.0  # how often a start-up wait looks at the embedded raylet (one waitpid)


def wait_watching_the_node(refs: list[Any], deadline: float | None, watch_node: bool,
                           when: str = "while the ranks started") -> list[Any]:  # fmt: skip
    """The refs of ``refs`` ready first (one at least), or none once ``deadline`` (monotonic; None:
    no deadline) passed. With ``watch_node``, ConnectionError naming the node as soon as the
    embedded raylet is found dead (``when``, in its line): the ranks' actors, or the placement
    groups they go in, would wait for it until the deadline (cluster.build_timeout_s, 30 minutes
    by default)."""
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = left if not watch_node else NODE_CHECK_S if left is None else min(left, NODE_CHECK_S)
        ready, _ = ray.wait(refs, num_returns=1, timeout=step)
        if ready:
            return list(ready)
        if watch_node and (problem := embedded_node_death(when)) is not None:
            raise ConnectionError(problem)
        if deadline is not None and time.monotonic() >= deadline:
            return []


def raylet_end_problem(process: subprocess.Popen[Any], logs: str | None, when: str = "as Ray started") -> str | None:
    """Why an embedded raylet (``process``, this process's child) is no more, as the driver's one
    line (``when`` it died), or None while it runs."""
    code = process.poll()
    if code is None:
        return None
    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return raylet_died_as_ray_started(process.pid, how, logs, when)


def _probe(address: str) -> None:
    """ConnectionError unless the cluster ``address`` names is recorded and listening."""
    from megarl.ray_cluster.address import address_problem

    problem = address_problem(address)
    if problem is not None:
        raise ConnectionError(problem)


def _init(**kwargs: Any) -> None:
    """ray.init, keeping a SIGTERM handler of this process's own (megarl's RunControl), at the C
    level too (:func:`_python_handles_sigterm`).

    ray.init installs a handler that exits at once (``sys.exit(15)``), and a signal that lands
    while it forks its daemons can even be swallowed (an exception in an at-fork callback is
    ignored): the stop would be lost. So when this process has a Python handler, Ray is kept
    from installing its own during the init, and a signal then reaches ours, which records it.
    Whatever an interrupted init started is shut down. Without a Python handler, Ray's stays."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ours = callable(previous)
    utils = ray._private.utils  # where ray.init looks its installer up, at call time
    install = getattr(utils, "set_sigterm_handler", None)  # another Ray: the SystemExit path below
    if ours and install is not None:
        utils.set_sigterm_handler = lambda handler: None
    embedded = kwargs.get("address") == "local"
    before = _descendants() if embedded else set()
    try:
        with still_waiting("starting Ray" if embedded else f"connecting to Ray at {kwargs.get('address')}"):
            ray.init(**kwargs)
        if main:
            _python_handles_sigterm()
    except BaseException as exc:  # a signal (SIGTERM, Ctrl-C) or an error: leave no half-started Ray
        dead = _dead_raylet(before) if embedded and isinstance(exc, Exception) else None
        try:
            if dead is not None:  # Ray says only that the node "timed out during startup"
                raise ConnectionError(dead) from exc
            if callable(previous) and isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:  # Ray's handler after all
                signal.signal(signal.SIGTERM, previous)
                previous(signal.SIGTERM, None)  # records the stop; raises KeyboardInterrupt
            raise
        finally:
            started = _ray_processes_since(before) if embedded else []  # before the shutdown re-parents them
            ray.shutdown()
            _kill(started)
    finally:
        if install is not None:
            utils.set_sigterm_handler = install


def _python_handles_sigterm() -> None:
    """SIGTERM back to Python's handler (ours, or Ray's where there was none). Ray's core worker
    installs absl's failure-signal handler for SIGTERM at the C level in the driver: each SIGTERM
    then prints "*** SIGTERM received at time=... ***" and a C++ stack on stderr before it passes
    the signal on, noise before megarl's one line. Setting the Python handler again puts Python's
    own C handler back in place (absl's stays for the crash signals, where its stack says something)."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)


def _dead_raylet(before: set[int]) -> str | None:
    """The line for a raylet this driver started since ``before`` that is already dead (killed
    while Ray started), or None."""
    import psutil

    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for process in started:
        try:
            if process.name() == "raylet" and process.status() == psutil.STATUS_ZOMBIE:
                return raylet_died_as_ray_started(process.pid, _how_it_ended(process.pid), _session_logs(started))
        except psutil.Error:  # gone meanwhile
            continue
    return None


def _how_it_ended(pid: int) -> str:
    """How a dead child not yet reaped ended ("was killed by SIGKILL", "exited with code 1"), read
    without reaping it (Ray's record of the process reaps it later); "ended" where that cannot be
    read (a grandchild, no waitid)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (OSError, AttributeError):
        return "ended"
    if info is None:
        return "ended"
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"was killed by {signal_name(info.si_status)}"
    return f"exited with code {info.si_status}"


def _session_logs(processes: list[Any]) -> str | None:
    """The logs folder of the Ray session ``processes`` (psutil's, a Ray start's) belong to, from
    the command line of one still running (the GCS's, an agent's: ``--session-dir=``; a dead
    raylet's says nothing); None when none says."""
    folder = session_dir(process.pid for process in processes)
    return os.path.join(folder, "logs") if folder else None


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _ray_processes_since(before: set[int]) -> list[Any]:
    """The Ray processes this driver started since ``before`` (its descendants then), as psutil
    processes: an init interrupted before Ray recorded its node leaves no node to shut down, and
    the raylet's agents, which block SIGTERM (megarl/process_signals.py), would outlive the driver.
    Taken before the shutdown: once it kills the raylet, its agents are no longer our descendants."""
    import psutil

    ray_dir = os.path.dirname(ray.__file__)  # the raylet, the GCS and Ray's python scripts live here
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            ours = any(arg.startswith(("ray::", ray_dir)) for arg in process.cmdline())  # ray::<name>: Ray's workers and agents
        except psutil.Error:
            continue
        if process.pid not in before and ours:
            found.append(process)
    return found


def _kill(processes: list[Any]) -> None:
    """SIGKILL each of ``processes`` still running (psutil: never a later process that took its pid)."""
    import psutil

    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            continue


def _shutdown_embedded() -> None:
    """ray.shutdown of an embedded Ray whose processes block SIGTERM and SIGHUP (megarl/process_signals.py).
    Ray SIGTERMs each of its processes and waits a second before the SIGKILL: that second is only
    a wait here, so it goes to the SIGKILL at once. The raylet's agents, which a SIGTERM to the
    raylet would have stopped, are killed with the rest of the tree taken before the shutdown.
    Another Ray (no such internals): its own shutdown."""
    import psutil

    node = getattr(ray._private.worker, "_global_node", None)
    tree: list[psutil.Process] = []
    for infos in getattr(node, "all_processes", {}).values():
        for info in infos:
            try:
                process = psutil.Process(info.process.pid)
                tree += [process, *process.children(recursive=True)]
            except (AttributeError, psutil.Error):
                continue
    kill = getattr(node, "kill_all_processes", None)
    if node is not None and kill is not None:  # (no node: no kill either)
        node.kill_all_processes = lambda **kwargs: kill(**(kwargs | {"allow_graceful": False}))
    ray.shutdown()
    for process in tree:
        try:
            process.kill()  # (psutil: not a later process that reuses the pid)
        except psutil.Error:
            continue


@contextmanager
def _quiet_auth_notice() -> Iterator[None]:
    """Ray warns on every embedded start that it turned token authentication on; it does so for
    a local cluster only this driver uses, so the notice is noise (the setting is unchanged)."""
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth.level
    auth.setLevel(logging.ERROR)
    try:
        yield
    finally:
        auth.setLevel(level)


# The reaper (a separate, tiny process: psutil and the standard library only). argv: the
# driver's pid. It polls the driver's process tree while it waits; on EOF on stdin without
# "done" (the driver died), it freezes every process it saw (and their children), then kills them.
_REAPER_CODE = r"""
import os, select, signal, sys, time
import psutil

driver = psutil.Process(int(sys.argv[1]))
me = os.getpid()
seen = {}

def scan(procs):
    for p in list(procs):
        try:
            for c in [p] + p.children(recursive=True):
                if c.pid not in (me, driver.pid):
                    seen.setdefault(c.pid, c)
        except psutil.Error:
            pass

done = False
while True:
    ready = select.select([0], [], [], 0.5)[0]
    if ready:
        data = os.read(0, 64)
        done = b"done" in data
        if not data or done:
            break
    scan([driver])
if done:
    sys.exit(0)
for _ in range(5):  # freeze first: a frozen parent starts nothing new while its tree is collected
    alive = [p for p in seen.values() if p.is_running()]
    if not alive:
        break
    for p in alive:
        try:
            p.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass
    scan(alive)
    for p in list(seen.values()):
        try:
            p.kill()
        except psutil.Error:
            pass
    time.sleep(0.2)
"""


def start_reaper() -> subprocess.Popen | None:
    """Start the reaper of this driver's processes (see the module docstring); None if it cannot."""
    try:
        # Without the supervised driver's tag: the supervisor's sweep of the tagged processes must not
        # end the reaper between its SIGSTOP and its SIGKILL of Ray's agents, which carry no tag and
        # would stay stopped for good.
        env = {k: v for k, v in os.environ.items() if k != DRIVER_TAG_ENV}
        return subprocess.Popen([sys.executable, "-c", _REAPER_CODE, str(os.getpid())], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    except OSError as exc:  # no reaper is no reason not to train
        log.warning("ray_session: cannot start the process reaper (%s); a killed driver may leave Ray processes behind", exc)
        return None


def stop_reaper(reaper: subprocess.Popen) -> None:
    """The driver is exiting normally: the reaper goes without killing anything."""
    try:
        reaper.stdin.write(b"done\n")  # type: ignore[union-attr]
        reaper.stdin.close()  # type: ignore[union-attr]
        reaper.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        reaper.kill()


def _describe(started_here: bool) -> RaySession:
    ctx = ray.get_runtime_context()
    address = getattr(ctx, "gcs_address", "") or ""
    return RaySession(address=address, started_here=started_here, resources=dict(ray.cluster_resources()))


def save_timeline(path: str | Path) -> Path:
    """Write Ray's timeline of tasks and actor calls so far (Chrome trace JSON) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ray.timeline(filename=str(path))
    return path
