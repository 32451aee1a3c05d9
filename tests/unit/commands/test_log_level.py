"""`megarl --log-level` (or MEGARL_LOG_LEVEL): megarl's loggers' level in the driver and in the
worker processes; info, the default, changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# A command whose handler logs at each level (megarl plot's, patched): what the terminal shows.
DRIVER = """
import logging, os, sys
import megarl.commands.plot as plot
def handler(args):
    log = logging.getLogger("megarl.x")
    log.debug("deep"); log.info("said"); log.warning("warned")
    print("env", os.environ.get("MEGARL_LOG_LEVEL"), flush=True)
    return 0
plot._run = handler
from megarl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(code: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MEGARL_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**environ, "PYTHONPATH": str(ROOT), **(env or {})}, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "shown", "hidden", "passed_on"),
    [
        (["plot", "x"], {}, ["said", "warned"], ["deep"], "None"),
        (["--log-level", "debug", "plot", "x"], {}, ["DEBUG megarl.x: deep", "said", "warned"], [], "debug"),
        (["plot", "x", "--log-level", "warning"], {}, ["warned"], ["deep", "said"], "warning"),
        (["plot", "x"], {"MEGARL_LOG_LEVEL": "error"}, [], ["deep", "said", "warned"], "error"),
        (["--log-level", "info", "plot", "x"], {"MEGARL_LOG_LEVEL": "debug"}, ["said"], ["deep"], "None"),
    ],
)  # fmt: skip
def test_the_log_level_sets_megarls_loggers_in_the_driver(args, env, shown, hidden, passed_on):
    done = _run(DRIVER, args, env)
    assert done.returncode == 0, done.stderr
    assert all(s in done.stderr for s in shown) and not any(h in done.stderr for h in hidden), done.stderr
    assert f"env {passed_on}" in done.stdout  # what the workers get (ray_session passes it on)


def test_a_bad_log_level_is_refused():
    done = _run(DRIVER, ["plot", "x"], {"MEGARL_LOG_LEVEL": "loud"})
    assert done.returncode == 2 and "MEGARL_LOG_LEVEL='loud' is not a log level; use one of debug, info" in done.stderr


WORKER = """
import logging, sys
from megarl.ray_cluster.worker_group import output_to_log
output_to_log(sys.argv[1])  # what every megarl actor does first
log = logging.getLogger("megarl.worker")
log.debug("deep"); log.info("said"); log.warning("warned")
"""


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [(None, ["warned"], ["deep", "said"]), ("debug", ["DEBUG megarl.worker: deep", "INFO megarl.worker: said", "warned"], []),
     ("error", [], ["deep", "said", "warned"])],
)  # fmt: skip
def test_the_log_level_reaches_a_worker_process_log(tmp_path, level, shown, hidden):
    log = tmp_path / "rank0.log"
    done = _run(WORKER, [str(log)], {"MEGARL_LOG_LEVEL": level} if level else {})
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert all(s in text for s in shown) and not any(h in text for h in hidden), text


def test_ray_session_passes_the_level_to_every_worker(monkeypatch):
    from megarl.ray_cluster import session

    seen = {}
    monkeypatch.setattr(session, "_init", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(session, "_probe", lambda address: None)
    monkeypatch.setattr(session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(session.ray, "shutdown", lambda: None)
    monkeypatch.setattr(session, "_describe", lambda started_here: None)
    monkeypatch.setenv("MEGARL_LOG_LEVEL", "debug")
    with session.ray_session("10.0.0.1:6379", env_vars={"A": "1"}):
        pass
    assert seen["runtime_env"] == {"env_vars": {"MEGARL_LOG_LEVEL": "debug", "A": "1"}}
    monkeypatch.delenv("MEGARL_LOG_LEVEL")
    with session.ray_session("10.0.0.1:6379"):
        pass
    assert seen["runtime_env"] is None  # the default: as before
