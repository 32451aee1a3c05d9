"""`megarl convert` with Ray, supervised as `megarl launch` is (megarl/commands/supervision.py):
its embedded raylet killed (kill -9) while the ranks build ends in one `error:` line naming the
dead node and its raylet's logs, and what the conversion leaves (OUT as it was), with exit code 2;
before, Ray's core worker ended the driver at the C level without a line. Nothing of Ray's is
printed before it, and no process of the run outlives it. A SIGTERM meanwhile is the stop's one
line, with no C++ stack before it. Two real Ray runs; the
supervisor's other endings (a driver killed, a driver's os._exit) are tested without Ray in
tests/unit/commands/test_supervised_commands.py and tests/unit/test_driver_supervisor.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
import pytest

from megarl.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
MARK = "MEGARL_TEST_SUPERVISED_MARK"  # marks this command's processes: other Rays run on this machine too


def _marked(mark: str, name: str | None = None) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if name in (None, p.info["name"]) and p.environ().get(MARK) == mark:
                found.append(p)
        except psutil.Error:  # gone, or not ours to read
            continue
    return found


@contextmanager
def _convert_building_ranks(tmp_path):
    """`megarl convert hf-to-megatron --tp 2` of a tiny model, with Ray, output into a log file;
    yields (process, log, OUT, mark) once its ranks build (Ray is up); the run killed on the way out."""
    model = build_tiny_model(tmp_path / "hf", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)
    out, log = tmp_path / "ckpt", tmp_path / "convert.log"
    mark = f"{os.getpid()}-{time.time_ns()}"
    args = [sys.executable, "-m", "megarl.cli", "convert", "hf-to-megatron", "--hf", str(model), "--out", str(out), "--tp", "2"]
    with log.open("w") as f:
        proc = subprocess.Popen(args, cwd=tmp_path, env={**os.environ, MARK: mark, "OMP_NUM_THREADS": "1"}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "building ImportRank" not in log.read_text():  # the ranks build: Ray is up
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        yield proc, log, out, mark
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_raylet_killed_under_convert_is_one_line_naming_the_node(tmp_path):
    with _convert_building_ranks(tmp_path) as (proc, log, out, mark):
        (raylet,) = _marked(mark, "raylet")
        raylet.kill()
        proc.wait(timeout=300)
    output = log.read_text()
    for logs in re.findall(r"\(logs: (\S+megarl-convert-logs-\w+)\)", output):  # the ranks' logs: a killed driver keeps them
        shutil.rmtree(logs, ignore_errors=True)
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    if errors[0].startswith("error: the Ray node under the run died: node "):  # the supervisor's line
        assert "/raylet.out and raylet.err" in errors[0], errors[0]
        assert errors[0].endswith(f"{out} is as it was (a conversion writes beside it and swaps it in only once verified; "
                                  "the next convert to it removes the staging folder left): run the same command again")  # fmt: skip
    elif errors[0].startswith("error: the Ray node under the run died while the ranks started"):  # the start's watch
        assert re.search(r"its raylet \(pid \d+\) was killed by SIGKILL; .*/raylet.out and raylet.err", errors[0]), errors[0]
    else:  # a rank's failed call met first: the driver's own line, which names the node's death too
        assert re.search(r"its node \S+ \(id \w+\) died \(its raylet does not answer|Ray marked it dead", errors[0]), errors[0]
    assert not out.exists()
    # Ray's own words stay off the terminal (the raylet's death report, the GCS's "marked dead", its C++ lines)
    assert not re.search(r"^\(raylet\)|marked dead|\.cc:\d+:|\*\*\* SIG", output, re.M), output[-3000:]
    assert not _marked(mark), "processes of the run outlived the command"  # Ray's workers included


def test_a_sigterm_to_convert_under_ray_is_its_one_stop_line(tmp_path):
    """SIGTERM to `megarl convert` while its Ray ranks build: the stop's one line, exit code 143,
    nothing before it from Ray (absl's "*** SIGTERM received ..." stack, which Ray's core worker
    installs in the driver at the C level), no process of the run left, OUT as it was."""
    with _convert_building_ranks(tmp_path) as (proc, log, out, mark):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    output = log.read_text()
    assert proc.returncode == 143, output[-3000:]
    assert output.splitlines()[-1] == "stopped by SIGTERM while converting; OUT is as it was (the staging folder is removed); run the same command again"
    assert "SIGTERM received" not in output and "PC: @" not in output, output[-3000:]
    assert not [line for line in output.splitlines() if line.startswith("error:")], output[-3000:]
    assert not out.exists() and not _marked(mark)
