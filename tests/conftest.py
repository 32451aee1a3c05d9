"""Test folders whose helper modules (run_helpers.py, agent_doubles.py, and tests/distributed's
spawn.py for the end-to-end tests that run a trainer in a process of its own) are imported by
plain name: put them on sys.path (``--import-mode=importlib`` does not). Fixtures every folder may use."""

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in ("e2e", "distributed", os.path.join("unit", "rollout", "agents")):
    _path = os.path.join(_HERE, _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)


@contextlib.contextmanager
def _read_only_dir(path: Path):
    """A directory nobody can write into, root included (a read-only tmpfs when we are root)."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("root without the right to mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def read_only_dir():
    """``with read_only_dir(path) as ro:`` a directory nobody can write into."""
    return _read_only_dir


@pytest.fixture
def real_wandb():
    """The real W&B SDK (skipped where it is missing), with its process-wide state torn down
    before and after the test: W&B reads its settings (WANDB_MODE, the key) from the environment
    once per process, so a test that set them up would decide the next test's run."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield wandb
    wandb.teardown()


@pytest.fixture
def refused_port():
    """A local TCP port that refuses connections for the whole test: bound and not listening, and
    held (a port closed before use could be taken meanwhile by another test's server, under -n)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
