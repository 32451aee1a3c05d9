"""The code sandbox, in both modes: plain (rlimits + scratch dir + clean env + audit guard)
and bubblewrap (skipped where bwrap is missing or cannot create namespaces)."""

import json
import os
import socket

import pytest

from megarl.rewards import compute_score
from megarl.rewards.code_sandbox import bwrap_available, extract_program, parse_tests, run_program
from megarl.tagged_processes import DRIVER_TAG_ENV

MODES = [
    pytest.param(False, id="plain"),
    pytest.param(
        True,
        id="bwrap",
        marks=pytest.mark.skipif(
            not bwrap_available(), reason="bubblewrap missing or cannot create namespaces here"
        ),
    ),
]
DOUBLE = "```python\nprint(int(input()) * 2)\n```"
# A generous wall-clock limit: these cases test scoring, not the limit (a loaded 2-core CI
# machine can take seconds to start a sandboxed interpreter).
TESTS = {"tests": [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "10"}], "time_limit_s": 20}


def test_extract_last_python_block():
    text = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```\nplain\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("no code") is None


def test_correct_wrong_and_partial_programs():
    assert compute_score("code", DOUBLE, None, TESTS) == 1.0
    assert compute_score("code", "```python\nprint(4)\n```", None, TESTS) == 0.5
    assert compute_score("code", "```python\nprint(4)\n```", None, {**TESTS, "mode": "all"}) == 0.0
    assert compute_score("code", "```python\nprint(int(input()) + 1)\n```", None, TESTS) == 0.0
    assert compute_score("code", "no program here", None, TESTS) == 0.0


def test_tests_from_json_ground_truth():
    truth = json.dumps({"inputs": ["3\n"], "outputs": ["6\n"]})
    assert compute_score("codecontests", DOUBLE, truth) == 1.0
    with pytest.raises(ValueError, match='extra_info\\["tests"\\]'):
        parse_tests("not tests", {})


def test_output_compare_ignores_trailing_whitespace_only():
    info = {"tests": [{"input": "", "output": "a\nb\n\n"}], "time_limit_s": 20}
    assert compute_score("code", "```python\nprint('a  ')\nprint('b')\n```", None, info) == 1.0
    assert compute_score("code", "```python\nprint(' a')\nprint('b')\n```", None, info) == 0.0


@pytest.mark.parametrize("bwrap", MODES)
def test_runs_with_stdin(bwrap):
    result = run_program(
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))", "1 2 3", time_limit_s=20, use_bwrap=bwrap
    )
    assert (result.returncode, result.stdout, result.timed_out) == (0, "6\n", False)


@pytest.mark.parametrize("bwrap", MODES)
def test_infinite_loop_is_killed(bwrap):
    result = run_program("while True:\n    pass", time_limit_s=0.5, use_bwrap=bwrap)
    assert result.timed_out and result.returncode is None
    assert result.seconds < 5.0  # killed near the 0.5 s limit, not left running


@pytest.mark.parametrize("bwrap", MODES)
def test_memory_bomb_fails_inside_limit(bwrap):
    result = run_program(
        "x = bytearray(2 * 1024**3)\nprint('allocated')", memory_limit_mb=256, time_limit_s=20, use_bwrap=bwrap
    )
    assert result.returncode != 0 and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize("bwrap", MODES)
def test_write_outside_scratch_does_not_land(bwrap, tmp_path):
    target = tmp_path / "escape.txt"
    program = f"open({str(target)!r}, 'w').write('escaped')\nopen('inside.txt', 'w').write('ok')\nprint('done')"
    result = run_program(program, time_limit_s=20, use_bwrap=bwrap)
    assert not target.exists()
    if not bwrap:  # the audit guard refuses the write; under bwrap it lands in the sandbox's tmpfs
        assert "PermissionError" in result.stderr


@pytest.mark.parametrize("bwrap", MODES)
def test_socket_to_host_loopback_does_not_connect(bwrap):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\nprint('sent')"
        result = run_program(program, time_limit_s=20, use_bwrap=bwrap)
        server.settimeout(0.1)  # a completed connection would wait in the backlog
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.returncode != 0 and "sent" not in result.stdout
    # plain mode: the audit guard refuses sockets (not a boundary: see docs/rewards.md);
    # bwrap: the sandbox has its own network namespace, so its 127.0.0.1 is not the host's.
    assert ("PermissionError" in result.stderr) != bwrap


@pytest.mark.parametrize("bwrap", MODES)
def test_environment_is_fresh_and_scratch_is_removed(bwrap, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2")
    result = run_program(
        "import os\nprint(sorted(os.environ))\nprint(os.getcwd())", time_limit_s=20, use_bwrap=bwrap
    )
    names, cwd = result.stdout.splitlines()
    assert "MEGARL_TEST_SECRET" not in names and "hunter2" not in result.stdout
    if not bwrap:
        assert not os.path.exists(cwd)


@pytest.mark.parametrize("bwrap", MODES)
@pytest.mark.parametrize("tag", ["4242-17", None], ids=["supervised", "not-supervised"])
def test_a_supervised_run_s_tag_reaches_the_program(bwrap, monkeypatch, tag):
    """The one variable passed through: a supervised run's tag, by which its end finds a program
    left running (megarl/tagged_processes.py); nothing of it without a supervisor."""
    if tag is None:
        monkeypatch.delenv(DRIVER_TAG_ENV, raising=False)
    else:
        monkeypatch.setenv(DRIVER_TAG_ENV, tag)
    result = run_program(f"import os\nprint(os.environ.get({DRIVER_TAG_ENV!r}))", time_limit_s=20, use_bwrap=bwrap)
    assert result.stdout.strip() == str(tag)


def test_tests_as_numpy_arrays_from_parquet():
    np = pytest.importorskip("numpy")
    tests = np.array(
        [{"input": "2\n", "output": "4"}, {"input": "3\n", "output": "6"}], dtype=object
    )
    assert parse_tests(None, {"tests": tests}) == [
        {"input": "2\n", "output": "4"},
        {"input": "3\n", "output": "6"},
    ]
    columns = {"inputs": np.array(["1\n"]), "outputs": np.array(["2"])}
    assert parse_tests(None, {"tests": columns}) == [{"input": "1\n", "output": "2"}]
