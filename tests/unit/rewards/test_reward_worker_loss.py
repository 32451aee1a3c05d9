"""A reward worker killed from outside while no sample runs on it (the OOM killer between steps):
pebble breaks its whole pool when a worker dies with no task running. The scorer starts a new
pool once and scores every sample of the call, and leaves no process behind at close."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megarl.config.sections import RewardConfig
from megarl.rewards import RewardScorer

pytestmark = pytest.mark.timeout(300)

SOURCES = ["openai/gsm8k"] * 12
SOLUTIONS = [f"The answer is\n#### {i}" for i in range(12)]
TRUTHS = [str(i if i % 3 else i + 1) for i in range(12)]  # every third answer is wrong
EXPECTED = [float(i % 3 != 0) for i in range(12)]


def _workers(before: set[int]) -> set[int]:
    """Processes started since ``before`` that are not our own children: the pool's workers (the
    forkserver's children; the forkserver and the resource tracker are children of this process)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in before and child.ppid() != os.getpid() and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_until(condition) -> None:
    """Poll ``condition``, however long a loaded machine takes: a wait that never ends fails at the
    pytest-timeout mark (the test asserts outcomes, not elapsed times)."""
    while not condition():
        time.sleep(0.05)


def _kill_one_worker(before: set[int]) -> int:
    workers = _workers(before)
    assert len(workers) == 2, workers
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    _wait_until(lambda: victim not in _workers(before))
    return victim


NEW_POOL = ("reward: the reward workers' pool broke (a worker died while no sample ran on it: killed from outside, "
            "by the OOM killer say, or dying as it started); starting a new pool for this call's 12 unscored samples")


def _restarts(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "pool broke" in r.getMessage()]


@pytest.mark.parametrize("noticed", [True, False], ids=["pool-broken-before-the-call", "killed-just-before-the-call"])
def test_worker_killed_while_idle_is_replaced_and_no_sample_is_lost(caplog, noticed):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    scorer = RewardScorer(RewardConfig(workers=2, timeout_s=30.0))
    try:
        assert scorer.score(SOURCES, SOLUTIONS, TRUTHS).scores == EXPECTED
        victim = _kill_one_worker(before)
        if noticed:  # pebble's manager thread marks the pool broken (schedule then raises)
            _wait_until(lambda: not scorer._pool.active)
        with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
            result = scorer.score(SOURCES, SOLUTIONS, TRUTHS)
            assert (result.scores, result.errors, result.timeouts) == (EXPECTED, 0, 0)
            assert victim not in _workers(before)
            if noticed:
                assert _restarts(caplog) == [NEW_POOL]
            # The pool goes on: a third call scores. The one death costs one new pool at most: killed
            # just before the second call, pebble may replace the worker itself (a task was running on
            # the other one when it looked), or break the pool amid that call or only after it.
            assert scorer.score(SOURCES, SOLUTIONS, TRUTHS).scores == EXPECTED
            if noticed:
                assert _restarts(caplog) == [NEW_POOL]
            else:
                assert len(_restarts(caplog)) <= 1, caplog.text
    finally:
        scorer.close()
    _wait_until(lambda: not _workers(before))


# A driver in its own process group, as a launch is: its SIGTERM handler records the stop (the
# trainer's RunControl does), and the reward function sends a SIGTERM to that whole group while
# its sample is being scored (what `timeout` or `kill -TERM -PGID` sends mid-step).
_GROUP_SIGTERM_DRIVER = """
import json, os, signal, sys
from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.rewards import RewardScorer

got = []

def main():
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    os.environ["DRIVER_PGID"] = str(os.getpgrp())
    scorer = RewardScorer(RewardConfig(workers=2, timeout_s=60.0, custom=CustomRewardConfig(path=sys.argv[1])))
    try:
        result = scorer.score(["x"] * 4, ["a"] * 4, ["1"] * 4)
    finally:
        scorer.close()
    print(json.dumps({"got": got, "scores": result.scores, "errors": result.errors}))

if __name__ == "__main__":
    main()
"""

_GROUP_SIGTERM_REWARD = """
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    os.killpg(int(os.environ["DRIVER_PGID"]), signal.SIGTERM)
    time.sleep(0.5)  # still scoring when the signal lands
    return 1.0
"""


def test_a_sigterm_to_the_drivers_process_group_leaves_the_samples_being_scored(tmp_path):
    """The driver finishes the step on a SIGTERM to its process group and saves: the reward
    workers, children of the driver, must not die of it mid-sample (scored 0 as errors), as they
    do not of Ctrl-C."""
    import json
    import subprocess
    import sys

    (tmp_path / "driver.py").write_text(_GROUP_SIGTERM_DRIVER)
    (tmp_path / "reward.py").write_text(_GROUP_SIGTERM_REWARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "reward.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240, start_new_session=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["got"] and set(result["got"]) == {signal.SIGTERM}  # the driver was signalled
    assert (result["scores"], result["errors"]) == ([1.0] * 4, 0), done.stderr[-3000:]


TORN_DOWN = r"""
import sys
from megarl.config.sections import RewardConfig
from megarl.rewards.scorer import RewardScorer

class Unlinked:  # rebuilt in the new worker as a lock whose semaphore the teardown already unlinked
    def __reduce__(self):
        return (open, ("/dev/shm/megarl-test-no-such-semaphore",))

scorer = RewardScorer(RewardConfig(workers=1), log_path=sys.argv[1])
worker = scorer._context.Process(target=print, args=(Unlinked(),))
worker.start()
worker.join()
scorer.close()
print(worker.exitcode)
"""


def test_a_worker_dying_before_its_initializer_prints_to_the_log_not_the_terminal(tmp_path):
    """A worker started while the pool is torn down fails in multiprocessing's own unpickling
    (SemLock's FileNotFoundError), before the worker's initializer moves its output to the log:
    its traceback was the forkserver's, on the terminal."""
    log_file = tmp_path / "reward_workers.log"
    proc = subprocess.run([sys.executable, "-c", TORN_DOWN, str(log_file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"  # the worker failed as the torn-down one does
    assert "Traceback" not in proc.stderr and "FileNotFoundError" not in proc.stderr, proc.stderr
    assert "FileNotFoundError" in log_file.read_text()  # kept: it holds an error


LEAKS = r"""
import sys
from multiprocessing import resource_tracker
from megarl.config.sections import RewardConfig
from megarl.rewards.scorer import RewardScorer

with RewardScorer(RewardConfig(workers=1), log_path=sys.argv[1]):
    resource_tracker.register("/megarl-test-leaked", "semaphore")  # as a lock of a pool killed mid-teardown
"""


def test_the_resource_tracker_s_leak_notes_at_exit_stay_off_the_terminal(tmp_path):
    """multiprocessing's resource tracker, started by the scorer, warns of leaked semaphores as the
    command exits (after its last line): to the workers' log, not the terminal."""
    proc = subprocess.run([sys.executable, "-c", LEAKS, str(tmp_path / "reward_workers.log")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "leaked semaphore" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr
