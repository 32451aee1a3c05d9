"""A reward pool whose multiprocessing resource tracker is killed in the middle of a call (kill -9,
the OOM killer): the call and the pool's close finish, and nothing reaches the terminal (before:
multiprocessing's "process died unexpectedly, relaunching" warning and a KeyError traceback of the
new tracker per semaphore released). A real pool in a child process: its stderr is the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)  # the hang guard; the test asserts outcomes, not elapsed times

REWARD = """
import time

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)
    return 1.0
"""

CHILD = """
import os, signal, sys, time
from multiprocessing import resource_tracker
from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.rewards import RewardScorer

folder = sys.argv[1]
cfg = RewardConfig(custom=CustomRewardConfig(path=os.path.join(folder, "slow_reward.py"), name="slow"), workers=2, timeout_s=60)
n = 60
with RewardScorer(cfg, log_path=os.path.join(folder, "reward_workers.log")) as scorer:
    first = scorer.score(["t"] * 4, ["a"] * 4, ["x"] * 4)
    tracker = resource_tracker._resource_tracker._pid  # (multiprocessing's own record of its helper)
    done = []
    import threading
    def kill_midway():
        time.sleep(0.5)
        os.kill(tracker, signal.SIGKILL)
        done.append(tracker)
    threading.Thread(target=kill_midway, daemon=True).start()
    result = scorer.score(["t"] * n, ["a"] * n, ["x"] * n)
    again = scorer.score(["t"] * 4, ["a"] * 4, ["x"] * 4)
print("killed", bool(done), "scores", sum(first.scores) + sum(result.scores) + sum(again.scores), result.errors, result.timeouts)
"""


def test_a_killed_resource_tracker_costs_the_scoring_nothing_and_says_nothing(tmp_path):
    (tmp_path / "slow_reward.py").write_text(REWARD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}  # this tree's megarl
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "killed True scores 68.0 0 0"
    assert done.stderr == ""  # no relaunch warning, no KeyError traceback of the new tracker
    log = (tmp_path / "reward_workers.log").read_text()
    assert "megarl: multiprocessing's resource tracker died (killed from outside?); resource_tracker: process died " \
           "unexpectedly, relaunching.  Some resources might leak." in log


def test_the_tracker_probe_takes_the_tracker_s_lock():
    """The probe writes to the tracker's pipe: it waits while another thread holds the tracker's
    lock (registering a semaphore, starting the tracker), as multiprocessing's own callers do."""
    import threading
    from multiprocessing import resource_tracker

    from megarl.rewards.pool_helpers import tracker_died

    resource_tracker.ensure_running()
    result: list[bool] = []
    probe = threading.Thread(target=lambda: result.append(tracker_died()))
    with resource_tracker._resource_tracker._lock:
        probe.start()
        probe.join(timeout=0.5)
        assert probe.is_alive() and not result  # waiting for the lock
    probe.join(timeout=60)
    assert result == [False]
