"""The pre-launch check that imports the user's reward file in a child process: what the file
does at import (exit, print, sleep) is said in one finding or a progress line, and the child dies
with its parent whatever ends the parent (SIGTERM handled, SIGKILL through the parent-death
signal). Real child processes, real signals; orphans looked for with psutil."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.sections import CustomRewardConfig
from megarl.plan import import_check_child
from megarl.plan.import_check_child import reward_file_problem
from megarl.terminal import EXIT_SIGTERM

pytestmark = pytest.mark.timeout(
    300
)  # the hang guard; the tests assert outcomes, not elapsed times

SCORE = "\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
HANGS = ("import pathlib, time\npathlib.Path(__file__).with_name('importing').write_text('yes')\n"
         "time.sleep(10000)\n" + SCORE)  # fmt: skip
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _temporary_files_here(tmp_path, monkeypatch):
    """The check's log files (kept when a check fails) in the test's folder, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _problem(tmp_path: Path, source: str) -> str | None:
    path = tmp_path / "reward.py"
    path.write_text(source)
    return reward_file_problem(CustomRewardConfig(path=str(path)))


@pytest.mark.parametrize(("signum", "cause"), [
    ("SIGTERM", "a signal it sent to its own process or process group (os.kill, os.killpg), or a kill from outside"),
    ("SIGSEGV", "a crash in C code"),
    ("SIGKILL", "the kernel's out-of-memory killer or a kill -9")])  # fmt: skip
def test_a_signal_that_ends_the_import_is_named_with_its_likely_sender(tmp_path, signum, cause):
    problem = _problem(tmp_path, f"import os, signal\nos.killpg(os.getpgrp(), signal.{signum})\n" + SCORE)
    assert problem is not None and f"the check's process ended (killed by {signum}) while importing reward.custom from " in problem
    assert f"before it answered: {cause} at import" in problem, problem


def test_os_exit_at_import_is_named_with_its_exit_code_and_output(tmp_path):
    problem = _problem(
        tmp_path, "import os\nprint('setting up', flush=True)\nos._exit(0)\n" + SCORE
    )
    assert problem is not None and problem.startswith("reward.custom: loading 'compute_score' from")
    assert (
        f"the check's process ended (exit code 0) while importing reward.custom from {tmp_path / 'reward.py'}, "
        "before it answered"
    ) in problem
    assert (
        "did not" not in problem and "'setting up'" in problem
    )  # no timeout said; its output quoted


def test_sys_exit_at_import_is_said_as_such(tmp_path):
    problem = _problem(tmp_path, "import sys\nsys.exit(3)\n" + SCORE)
    assert problem is not None and "failed: it called sys.exit(3) at import (line 2)" in problem


def test_printing_at_import_is_no_problem_and_leaves_no_log(tmp_path):
    source = "print('hello from the import')\nimport sys\nprint('x', file=sys.stderr)\n" + SCORE
    assert _problem(tmp_path, source) is None
    assert not list(tmp_path.glob("megarl-import-check-*"))


def test_a_failed_check_keeps_its_log_and_names_it(tmp_path):
    problem = _problem(tmp_path, "print('why it fails')\nraise ValueError('no')\n" + SCORE)
    logs = list(tmp_path.glob("megarl-import-check-*.log"))
    assert (
        problem is not None
        and len(logs) == 1
        and f"(its output, in {logs[0]}: 'why it fails')" in problem
    )


def test_a_slow_import_says_what_it_imports_every_few_seconds(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(import_check_child, "PROGRESS_EVERY_S", 0.3)
    with caplog.at_level(logging.INFO, logger="megarl.plan.import_check_child"):
        assert _problem(tmp_path, "import time\ntime.sleep(2)\n" + SCORE) is None
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("importing reward.custom from")
    ]
    assert lines and all(
        line.endswith(" s)") and str(tmp_path / "reward.py") in line for line in lines
    ), lines


def _child_once_importing(parent: subprocess.Popen, marker: Path) -> psutil.Process:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert parent.poll() is None, parent.communicate()
        assert time.monotonic() < deadline, "the check never started importing"
        time.sleep(0.1)
    children = [c for c in psutil.Process(parent.pid).children() if "stop sentinel" not in " ".join(c.cmdline())]
    assert len(children) == 1, children  # (launch's: its driver, beside the sentinel of megarl/stop_origin.py)
    return children[0]


def _gone(process: psutil.Process) -> bool:
    """Ended (a zombie waits for a reaper this container may not run quickly)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_check_dies_with_a_killed_parent(tmp_path):
    (tmp_path / "reward.py").write_text(HANGS)
    code = ("from megarl.config.sections import CustomRewardConfig\nfrom megarl.plan.import_check_child import reward_file_problem\n"
            f"reward_file_problem(CustomRewardConfig(path={str(tmp_path / 'reward.py')!r}))\n")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    child = _child_once_importing(parent, tmp_path / "importing")
    parent.kill()  # SIGKILL: no handler, no finally
    parent.wait()
    assert _gone(child), "the import check outlived its killed parent"


@pytest.mark.parametrize("command", ["launch", "evaluate", "plan"])
def test_sigterm_during_the_check_ends_in_one_line_and_no_orphan(tmp_path, command):
    """`launch` and `plan --check-files` (which used to die of the signal, silently, leaving the
    child) and `evaluate`."""
    reward = tmp_path / "reward.py"
    reward.write_text(HANGS)
    data = tmp_path / "gen.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["mine"], "reward_model": [{"ground_truth": "4"}],
                             "responses": [["4", "5"]]}), data)  # fmt: skip
    config = [str(REPO / "configs" / "tiny_grpo.yaml"), f"trainer.output_dir={tmp_path / 'run'}"]
    args = {"launch": ["launch", *config], "plan": ["plan", "--check-files", *config],
            "evaluate": ["evaluate", "--data", str(data)]}[command]  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-m", "megarl.cli", *args, f"reward.custom.path={reward}"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    child = _child_once_importing(parent, tmp_path / "importing")
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == EXIT_SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM"), err
    assert _gone(child), "the import check outlived its stopped parent"


def test_a_tool_whose_init_calls_sys_exit_is_named_by_its_class(tmp_path, monkeypatch):
    """Not "at import": the file imports, the class's __init__ ends the process."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "quitting_tool.py").write_text(
        "import sys\nfrom megarl.rollout.agents.tool_base import Tool\n\n"
        "class Quits(Tool):\n    def __init__(self, config, tool_schema):\n        sys.exit(3)\n")  # fmt: skip
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: quitting_tool.Quits\n"
                     "    tool_schema: {type: function, function: {name: quits, parameters: {type: object}}}\n")  # fmt: skip
    child = import_check_child.ChildChecks(None, [("rollout.agent.tools_file", str(tools))])
    try:
        (finding,) = child.results("rollout.agent.tools_file")
    finally:
        child.stop()
    assert "Quits({}) called sys.exit(3) while it was built; a tool must raise an exception" in finding.message
    assert "at import" not in finding.message


def test_a_tool_and_an_interaction_whose_init_calls_os_exit_are_named_at_construction(tmp_path, monkeypatch):
    """os._exit in a class's __init__ ends the check's process without a word: the last thing it
    said it did (building that class, once imported) names the construction, not the import."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "exiting_classes.py").write_text(
        "import os\nfrom megarl.rollout.agents.tool_base import Tool\n\n"
        "class Exits(Tool):\n    def __init__(self, config, tool_schema):\n        os._exit(4)\n\n"
        "class ExitingUser:\n    def __init__(self, config):\n        os._exit(5)\n")  # fmt: skip
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: exiting_classes.Exits\n"
                     "    tool_schema: {type: function, function: {name: exits, parameters: {type: object}}}\n")  # fmt: skip
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text("interaction:\n  - name: user\n    class_name: exiting_classes.ExitingUser\n")
    for field, path, code, cls in (("rollout.agent.tools_file", tools, 4, "Exits"),
                                   ("rollout.agent.interactions_file", interactions, 5, "ExitingUser")):  # fmt: skip
        child = import_check_child.ChildChecks(None, [(field, str(path))])
        try:
            (finding,) = child.results(field)
        finally:
            child.stop()
        assert f"ended (exit code {code}) while building exiting_classes.{cls} (" in finding.message, finding.message
        assert "while it was built (in its __init__)" in finding.message and "at import" not in finding.message


def test_empty_logs_of_killed_drivers_are_removed_by_the_next_check(tmp_path):
    """A driver killed with SIGKILL leaves its check's log (no cleanup runs): the next check removes
    it when it is empty and its driver is gone; a log with output, or a live driver's, stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"megarl-import-check-{gone.pid}-abc.log"
    orphan.touch()
    told = tmp_path / f"megarl-import-check-{gone.pid}-def.log"
    told.write_text("the output a finding quoted\n")
    live = tmp_path / f"megarl-import-check-{os.getpid()}-ghi.log"
    live.touch()
    assert _problem(tmp_path, SCORE) is None
    assert not orphan.exists() and told.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.glob("megarl-import-check-*")) == sorted([told.name, live.name])  # its own removed too


def test_a_slow_import_that_works_is_a_warning_naming_the_file_and_its_time(tmp_path, monkeypatch):
    monkeypatch.setattr(import_check_child, "SLOW_IMPORT_S", 0.5)
    path = tmp_path / "reward.py"
    path.write_text("import time\ntime.sleep(1)\n" + SCORE)
    assert reward_file_problem(CustomRewardConfig(path=str(path))) is None  # a warning refuses nothing
    child = import_check_child.ChildChecks(CustomRewardConfig(path=str(path)), [])
    try:
        (finding,) = child.results("reward")
    finally:
        child.stop()
    assert (finding.field, finding.level) == ("reward.custom", "warning")
    assert finding.message.startswith(f"importing {path} took ") and "not counted in reward.timeout_s" in finding.message
