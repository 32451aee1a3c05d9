"""An embedded Ray whose raylet is killed as it starts (megarl/ray_cluster/session.py): the
driver's one line names the raylet's death (whether ray.init noticed it or the check right after
it did: one message for both), and no process of that Ray is left. Real Ray, in a child process;
the raylet is found among that child's descendants, never by name among all processes (other
Ray runs may share the machine). If the kill lands inside ray.init, Ray itself waits 30 s for the
node before it gives up (ray/_private/node.py, raylet_start_wait_time_s): the test takes that long."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

DRIVER = """
import sys
from megarl.ray_cluster.session import ray_session
try:
    with ray_session(num_cpus=1, log_to_driver=False):
        print("started", flush=True)
except ConnectionError as exc:
    print(exc, flush=True)
    sys.exit(3)
"""


def _kill_the_raylet_once_it_appears(driver: psutil.Process, seen: set[psutil.Process]) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for process in driver.children(recursive=True):
            seen.add(process)
            try:
                if process.name() == "raylet":
                    process.kill()
                    return process.pid
            except psutil.Error:
                continue
        time.sleep(0.02)
    raise AssertionError("no raylet appeared among the driver's descendants")


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone meanwhile
        return False


def test_a_raylet_killed_as_ray_starts_is_one_line_and_leaves_nothing():
    child = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[psutil.Process] = set()
    try:
        raylet = _kill_the_raylet_once_it_appears(psutil.Process(child.pid), seen)
        out, err = child.communicate(timeout=180)
        assert child.returncode == 3, (out, err)
        lines = out.strip().splitlines()
        assert len(lines) == 1, out
        assert lines[0].startswith(f"the Ray node under the run died as Ray started: its raylet (pid {raylet}) "), lines
        assert "dmesg" in lines[0] and "raylet.out" in lines[0] and lines[0].endswith("then run the same command again")
        assert "Traceback" not in err, err[-2000:]
        left = []
        for _ in range(300):  # what the interrupted start killed may take a moment to be reaped
            left = [p for p in seen if _running(p)]
            if not left:
                break
            time.sleep(0.1)
        assert not left, [" ".join(p.cmdline())[:100] for p in left]
    finally:
        child.kill()
        child.wait(timeout=60)
        for process in seen:
            try:
                process.kill()
            except psutil.Error:
                continue
