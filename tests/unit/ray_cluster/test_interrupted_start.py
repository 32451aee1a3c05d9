"""An embedded Ray start interrupted by Ctrl-C or SIGTERM leaves no process behind
(megarl/ray_cluster/session.py ``_kill_started_since``): the raylet's agents block SIGTERM, so
only a kill ends them, and an init interrupted before Ray recorded its node has no node to shut down."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from megarl.ray_cluster.session import _descendants, _kill_started_since

# A stand-in for ray::DashboardAgent: its command line names ray, and it ignores SIGTERM as Ray's
# agents do under megarl (process_signals.stop_signals_blocked_in_children).
AGENT = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"


def _start(tag: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", AGENT, tag], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_the_ray_processes_started_since_are_killed_and_nothing_else():
    older = _start("ray::OlderAgent")  # there before the start: not ours to kill
    before = _descendants()
    agent, other = _start("ray::DashboardAgent"), _start("some-other-process")
    try:
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert agent.poll() is None  # SIGTERM does not end it
        _kill_started_since(before)
        assert agent.wait(timeout=30) == -signal.SIGKILL
        assert older.poll() is None and other.poll() is None
        assert psutil.pid_exists(older.pid) and psutil.pid_exists(other.pid)
    finally:
        for proc in (older, agent, other):
            proc.kill()
            proc.wait(timeout=30)
