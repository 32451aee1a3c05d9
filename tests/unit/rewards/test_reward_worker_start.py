"""Reward workers that hang or die while loading reward.custom (in their initializer, where pebble's
task timeout does not reach): one clear error in bounded time, and no worker left behind.

Robust on a loaded machine: the start limit is shortened (SHORT_LIMIT_S) only where a start must
time out (an import that sleeps for days); a healthy start runs under the default 120 s, and a
worker that dies is reported by pebble, whatever the limit. The tests assert outcomes (the limit
named in the error proves the scorer's own bound ended the wait), never elapsed times; a wait
that does not end fails at the pytest-timeout mark."""

from __future__ import annotations

import logging
import os
import signal
import textwrap
import time

import pytest

from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.rewards import RewardScorer
from megarl.rewards import scorer as scorer_module
from megarl.rewards.scorer import RewardError

pytestmark = pytest.mark.timeout(300)

SHORT_LIMIT_S = 3.0  # WORKER_START_TIMEOUT_S where the start must time out (the import hangs for days)

# Breaks at import when always=True, or once a "break_now" file sits beside it (a replacement
# worker started later imports it again); each breaking worker leaves its pid in a file. Once a
# "die_after_load" file sits beside it, a worker loads it and dies as it asks pebble for its first
# task (a profile hook on pebble's fetch_task): a loaded worker that dies with no task pebble saw.
USER_REWARDS = textwrap.dedent(
    """
    import os, pathlib, sys, time

    HERE = pathlib.Path(__file__).parent
    if {always} or (HERE / "break_now").exists():
        (HERE / f"worker-{{os.getpid()}}").touch()
        if {hang}:
            time.sleep(10**6)
        os._exit(3)
    if (HERE / "die_after_load").exists():
        def exit_at_fetch(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "fetch_task":
                (HERE / f"worker-{{os.getpid()}}").touch()
                os._exit(3)
        sys.setprofile(exit_at_fetch)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "pid":
            return float(os.getpid())
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "slow":
            time.sleep({slow_s})
        return float(solution_str == ground_truth)
    """
)


def _shorten_start_limit(monkeypatch) -> None:
    """From now on (read at each wait): healthy starts before this call had the default limit."""
    monkeypatch.setattr(scorer_module, "WORKER_START_TIMEOUT_S", SHORT_LIMIT_S)


def _rewards(tmp_path, *, always: bool, hang: bool) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS.format(always=always, hang=hang, slow_s=SHORT_LIMIT_S + 2.0))
    return str(path)


def _new_pools(caplog) -> int:
    return sum("pool broke" in r.getMessage() for r in caplog.records)


def _breaking_workers(tmp_path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")}


def test_import_that_hangs_fails_in_bounded_time_and_leaves_no_worker(tmp_path, monkeypatch, still_running):
    path = _rewards(tmp_path, always=True, hang=True)
    _shorten_start_limit(monkeypatch)
    with pytest.raises(RewardError) as info:
        RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=2))
    assert str(info.value) == (
        "reward.custom: importing 'my_rewards.py' took more than 3 s in a reward worker; "
        "check it for work done at import (network, locks, long loops)"
    )
    hung = _breaking_workers(tmp_path)
    assert hung and not still_running(hung)


def test_worker_that_dies_at_import_is_named_with_the_way_to_see_why(tmp_path, still_running):
    path = _rewards(tmp_path, always=True, hang=False)
    with pytest.raises(RewardError) as info:
        RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=2))
    message = str(info.value)
    assert message.startswith("reward.custom: a reward worker died while importing 'my_rewards.py'")
    assert f"runpy.run_path({path!r})" in message and "BrokenProcessPool" not in message
    assert not still_running(_breaking_workers(tmp_path))


def test_import_that_raises_keeps_the_users_error(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(RewardError, match=r"loading 'compute_score' from .*my_rewards.py failed in a reward worker: "
                       r"ModuleNotFoundError: No module named 'not_installed_dependency_xyz'"):
        RewardScorer(RewardConfig(custom=CustomRewardConfig(path=str(path))))


def test_samples_waiting_behind_a_long_sample_are_not_a_stalled_start(tmp_path, monkeypatch):
    """Tasks that wait longer than the start limit while another runs are only queued."""
    path = _rewards(tmp_path, always=False, hang=True)
    with RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=1, timeout_s=30.0)) as scorer:
        _shorten_start_limit(monkeypatch)  # "slow" runs past it; the worker started under the default
        result = scorer.score(["any"] * 2, ["slow", "a"], ["a", "a"])
    assert (result.scores, result.errors, result.timeouts) == ([0.0, 1.0], 0, 0)


@pytest.mark.parametrize("hang", [True, False], ids=["hangs", "dies"])
def test_replacement_worker_breaking_at_import_stops_scoring_with_the_cause(tmp_path, monkeypatch, caplog, hang, still_running):
    """The file loaded at start; a worker started later (after one died in a sample) does not. One
    that dies breaks the pool (no task runs): one new pool is tried, whose worker dies too."""
    path = _rewards(tmp_path, always=False, hang=hang)
    scorer = RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=1, timeout_s=30.0))
    (tmp_path / "break_now").touch()
    if hang:
        _shorten_start_limit(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"), pytest.raises(RewardError) as info:
        scorer.score(["any"] * 2, ["exit", "a"], ["a", "a"])
    # dies: the replacement's death breaks the pool, and one new pool is tried. hangs: none, unless
    # pebble took the sample's death for one outside any task (its acknowledgement came too late)
    assert _new_pools(caplog) in ((0, 1) if hang else (1,))
    message = str(info.value)
    cause = "importing 'my_rewards.py' took more than 3 s" if hang else "died while importing 'my_rewards.py'"
    assert message.startswith(f"reward workers stopped taking samples: reward.custom: {'' if hang else 'a reward worker '}{cause}")
    assert message.endswith("the run stops rather than train on zero rewards") and "Unexpected error" not in message
    broke = _breaking_workers(tmp_path)
    assert broke and not still_running(broke)
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score(["any"], ["a"], ["a"])


def test_pool_broken_between_calls_and_a_new_worker_dying_at_import_fail_the_next_call_with_the_cause(tmp_path, caplog, still_running):
    """A worker killed while idle breaks pebble's pool (its next schedule says only "Unexpected error
    within the Pool"); the scorer starts one new pool, whose worker dies importing the file: the
    call fails naming that. (Killed from outside, not by a sample: a sample that kills its worker
    at once may reach pebble as a death outside any task, and break the pool in that call.)"""
    path = _rewards(tmp_path, always=False, hang=False)
    scorer = RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=1, timeout_s=30.0))
    worker = int(scorer.score(["any"], ["pid"], ["a"]).scores[0])
    (tmp_path / "break_now").touch()
    os.kill(worker, signal.SIGKILL)
    while scorer._pool.active:  # pebble notices the dead worker and marks the pool broken
        time.sleep(0.05)
    assert not _breaking_workers(tmp_path)  # no replacement was started
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"), pytest.raises(RewardError) as info:
        scorer.score(["any"], ["a"], ["a"])
    assert _new_pools(caplog) == 1
    assert str(info.value).startswith(
        "reward workers stopped taking samples: reward.custom: a reward worker died while importing 'my_rewards.py'"
    )
    broke = _breaking_workers(tmp_path)
    assert broke and not still_running(broke | {worker})


def test_new_pool_whose_loaded_worker_dies_is_not_called_a_death_at_import(tmp_path, caplog, still_running):
    """After a sample killed the worker, each new worker loads the file and dies before pebble saw
    it take a sample (as one killed from outside, or by a sample before pebble read its
    acknowledgement): the pool breaks, and the new pool breaks again. The error says the workers
    loaded and names the unscored samples, not an import."""
    path = _rewards(tmp_path, always=False, hang=False)
    scorer = RewardScorer(RewardConfig(custom=CustomRewardConfig(path=path), workers=1, timeout_s=30.0))
    (tmp_path / "die_after_load").touch()
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"), pytest.raises(RewardError) as info:
        scorer.score(["any"] * 2, ["exit", "a"], ["a", "a"])
    assert _new_pools(caplog) == 1
    message = str(info.value)
    assert message.startswith(
        "reward workers stopped taking samples: reward.custom: a reward worker died after it loaded, before pebble "
        "saw it take a sample: killed from outside (the OOM killer; see dmesg) or by a sample that ends its process "
        "at once (os._exit, a crash in C), maybe one of the call's "
    )
    # "exit" was scored as an error, unless pebble took its death for one outside any task
    assert "unscored samples (the first: data_source='any' response=" in message and "\n" not in message
    assert message.endswith(
        "; check dmesg, then score those samples in a plain Python process; the run stops rather than train on zero rewards"
    )
    died = _breaking_workers(tmp_path)
    assert len(died) >= 2 and not still_running(died)  # the first pool's replacement and the new pool's worker
