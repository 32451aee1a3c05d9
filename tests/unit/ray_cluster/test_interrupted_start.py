"""An embedded Ray start interrupted by Ctrl-C or SIGTERM leaves no process behind
(megarl/ray_cluster/session.py ``_ray_processes_since`` and ``_kill``): the raylet's agents block
SIGTERM, so only a kill ends them; an init interrupted before Ray recorded its node has no node to
shut down; and once the shutdown kills the raylet, its agents are no longer the driver's
descendants, so they are found before it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from megarl.ray_cluster.session import _descendants, _kill, _ray_processes_since

# Stand-ins: the "raylet" (its command line names ray, as ray::<name> does) starts an "agent" that
# ignores SIGTERM as Ray's agents do under megarl, and prints the agent's pid.
AGENT = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
RAYLET = ("import subprocess, sys, time; agent = subprocess.Popen([sys.executable, '-c', sys.argv[1], 'ray::DashboardAgent']); "
          "print(agent.pid, flush=True); time.sleep(300)")  # fmt: skip


def _gone(process: psutil.Process, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _wait_for_exec(process: psutil.Process, arg: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if arg in process.cmdline():
                return
        except psutil.Error:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{process.pid} never ran with {arg}")


def test_the_agents_found_before_the_shutdown_are_killed_after_it_and_nothing_else():
    older = subprocess.Popen([sys.executable, "-c", AGENT, "ray::OlderAgent"])  # there before the start: not ours
    before = _descendants()
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET, AGENT, "ray::Raylet"], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", AGENT, "some-other-process"])
    try:
        assert raylet.stdout is not None
        agent = psutil.Process(int(raylet.stdout.readline()))
        _wait_for_exec(agent, "ray::DashboardAgent")  # its pid is printed while it may still be in fork/exec
        started = _ray_processes_since(before)
        assert {p.pid for p in started} == {raylet.pid, agent.pid}
        raylet.kill()  # what the shutdown does: the agent is re-parented, no longer our descendant
        raylet.wait(timeout=30)
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert agent.is_running() and agent.pid not in _descendants()  # SIGTERM does not end it
        _kill(started)
        assert _gone(agent)
        assert older.poll() is None and other.poll() is None
    finally:
        for proc in (older, raylet, other):
            proc.kill()
            proc.wait(timeout=30)
