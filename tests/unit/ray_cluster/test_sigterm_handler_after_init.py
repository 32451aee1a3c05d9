"""After ray.init the driver's SIGTERM goes straight to its Python handler again
(megarl/ray_cluster/session.py ``_init``): Ray's core worker installs absl's failure-signal
handler for SIGTERM at the C level, which prints "*** SIGTERM received at time=... ***" and a C++
stack before passing the signal on, noise before the command's one line. Without Ray: ray.init's
stand-in installs faulthandler's C-level handler for SIGTERM, which likewise writes a stack and
chains to the previous handler."""

from __future__ import annotations

import subprocess
import sys

DRIVER = """
import faulthandler, os, signal, sys, time
import ray
from megarl.ray_cluster import session

signal.signal(signal.SIGTERM, lambda signum, frame: print("the command's handler", flush=True))
ray.init = lambda **kwargs: faulthandler.register(signal.SIGTERM, file=sys.stderr, chain=True)  # as absl's, at the C level
{start}
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
"""


def _run(start: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER.format(start=start)], capture_output=True, text=True, timeout=120)


def test_a_sigterm_after_ray_init_reaches_the_handler_without_a_stack_on_stderr():
    out = _run('session._init(address="local")')
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the command's handler"
    assert "Stack" not in out.stderr and "most recent call first" not in out.stderr, out.stderr


def test_the_stand_in_prints_a_stack_where_nothing_takes_sigterm_back():
    """What the test above would see, were SIGTERM not handed back: the stand-in is as noisy as absl's."""
    out = _run('ray.init(address="local")')
    assert out.stdout.strip() == "the command's handler"
    assert "most recent call first" in out.stderr, out.stderr
