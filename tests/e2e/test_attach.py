"""`megarl launch --address host:port` attaches to a running Ray cluster (here one started
with `ray start --head` on this machine) instead of starting an embedded one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import TINY, read_jsonl, small_overrides

from megarl.tagged_processes import DRIVER_TAG_ENV, end_tagged, new_tag

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_attaches_to_a_running_cluster(tmp_path):
    port = free_port()
    start = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=4",
             "--include-dashboard=false", "--disable-usage-stats"]
    # A loopback-only test cluster: no token auth, so the test needs no token files. Its processes
    # carry a tag of this test's, by which they are ended after it: `ray stop --force` would end
    # every Ray process on the machine (another run's, another test session's).
    tag = new_tag()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", DRIVER_TAG_ENV: tag}
    subprocess.run(start, check=True, capture_output=True, timeout=120, env=env)
    try:
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "megarl.cli", "launch", str(TINY), "--address", f"127.0.0.1:{port}",
               *small_overrides(tmp_path / "demo", out, 2)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Connected to Ray cluster" in proc.stderr  # it joined the cluster (and said so: its dashboard)
        assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    finally:
        end_tagged(tag)
