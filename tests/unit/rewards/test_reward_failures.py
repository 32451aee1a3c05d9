"""Reward functions that fail on every sample stop the run fast and visibly: real functions that
raise, sleep forever and return garbage, in a real worker pool."""

from __future__ import annotations

import logging
import textwrap

import pytest

from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.rewards import RewardScorer
from megarl.rewards.scorer import RewardError

pytestmark = pytest.mark.timeout(300)  # the hang guard; the tests assert outcomes, not elapsed times

TIMEOUT_S = 2.0
WORKERS = 2
BROKEN = textwrap.dedent(
    """
    import os, pathlib, time

    def raises(data_source, solution_str, ground_truth, extra_info=None):
        return 1 / len(solution_str.replace(solution_str, ""))

    def sleeps(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("fast"):
            return 1.0
        pathlib.Path(__file__).with_name(f"started-{os.getpid()}-{solution_str.replace(' ', '_')}").touch()
        time.sleep(3600)

    def garbage(data_source, solution_str, ground_truth, extra_info=None):
        return {"a": "not a score", "b": None, "c": [1.0]}.get(solution_str, float(solution_str == ground_truth))
    """
)


def scorer(tmp_path, name: str, **kw) -> RewardScorer:
    path = tmp_path / "broken_reward.py"
    path.write_text(BROKEN)
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(path), name=name), **{"timeout_s": TIMEOUT_S, "workers": WORKERS, **kw})
    return RewardScorer(cfg)


def score(s: RewardScorer, solutions: list[str]):
    return s.score(["task"] * len(solutions), solutions, ["x"] * len(solutions), [None] * len(solutions))


def test_raising_on_every_sample_stops_with_the_traceback(tmp_path):
    with scorer(tmp_path, "raises") as s, pytest.raises(RewardError) as info:
        score(s, ["a", "b", "c", "d"])
    msg = str(info.value)
    assert msg.startswith("reward.custom 'raises' (broken_reward.py) failed on 4 of 4 samples (4 errors, 0 timeouts)")
    assert "reward.max_failed_fraction (1)" in msg and "ZeroDivisionError: division by zero" in msg
    assert "Traceback (most recent call last)" in msg and "broken_reward.py" in msg and "return 1 / len(" in msg


def test_a_step_where_every_sample_hangs_ends_within_two_timeouts(tmp_path, caplog):
    """About 2 x timeout_s whatever the number of samples: once one round of the pool (WORKERS
    samples) timed out, the other samples are not run, so only that round and the samples already
    running when the scorer gave up (at most one per worker) ever started."""
    with scorer(tmp_path, "sleeps") as s, caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        with pytest.raises(RewardError) as info:
            score(s, [f"hang {i}" for i in range(16)])
    started = list(tmp_path.glob("started-*"))
    assert 1 <= len(started) <= 2 * WORKERS, started
    assert "failed on 16 of 16 samples (0 errors, 16 timeouts)" in str(info.value)
    assert "raise reward.timeout_s" in str(info.value)
    assert "timed out after 2 s (reward.timeout_s)" in caplog.text  # logged when it happened
    assert "counted as timeouts without running" in caplog.text


def test_some_hanging_samples_do_not_cost_the_others(tmp_path):
    with scorer(tmp_path, "sleeps") as s:
        result = score(s, ["fast 0", "fast 1", "hang", "fast 2", "fast 3", "hang", "fast 4"])
    assert result.scores == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert (result.errors, result.timeouts) == (0, 2)


def test_garbage_returns_are_errors_and_the_threshold_is_configurable(tmp_path):
    with scorer(tmp_path, "garbage") as s:
        result = score(s, ["a", "b", "x", "c", "x"])
        assert result.scores == [0.0, 0.0, 1.0, 0.0, 1.0] and result.errors == 3
    with scorer(tmp_path, "garbage", max_failed_fraction=0.5) as s, pytest.raises(RewardError) as info:
        score(s, ["a", "b", "x", "c", "x"])
    assert "failed on 3 of 5 samples" in str(info.value) and "returned str 'not a score'" in str(info.value)


def test_a_return_that_is_no_score_stops_in_one_line_said_for_the_caller(tmp_path, caplog):
    path = tmp_path / "broken_reward.py"
    path.write_text(BROKEN)
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(path), name="garbage"), timeout_s=TIMEOUT_S, workers=2)
    with RewardScorer(cfg, stops="evaluate stops rather than report them as scores of 0") as s, \
            caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"), pytest.raises(RewardError) as info:  # fmt: skip
        score(s, ["a", "b"])
    msg = str(info.value)
    assert "failed on 2 of 2 samples" in msg and "evaluate stops rather than report them as scores of 0" in msg
    # what was returned says it all: no traceback of megarl's own check, no warnings before the error
    assert "returned str 'not a score'" in msg and "\n" not in msg and "train" not in msg
    assert "reward error" not in caplog.text


def test_after_a_first_ctrl_c_a_hanging_function_is_given_up_after_the_grace(tmp_path, monkeypatch):
    """Before: a first Ctrl-C inside a step waited for every hanging sample's reward.timeout_s."""
    import os
    import signal
    import threading

    import megarl.user_code
    from megarl.trainer.watchdog import RunControl
    from megarl.user_code import WaitAbandoned

    monkeypatch.setattr(megarl.user_code, "STOP_GRACE_S", 1.0)
    control = RunControl()
    with control.handlers(), scorer(tmp_path, "sleeps", timeout_s=600.0) as s:
        control.deferred = True  # inside a step: the first signal asks for a stop after it
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            with pytest.raises(WaitAbandoned) as info:
                score(s, ["fast 0", "hang 1", "fast 2"])
        finally:
            timer.cancel()
    assert control.stop_requested and control.exit_code == 130
    assert str(info.value).startswith("reward.custom 'sleeps' (broken_reward.py) was waited on for ")
    assert str(info.value).endswith(" s and did not return within 1 s of the stop")
