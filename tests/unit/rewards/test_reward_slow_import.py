"""A reward file that is slow to import: the workers import it as they start (pebble's initializer),
before they take a sample, so reward.timeout_s never charges the import to a sample, a replacement
worker's included; an import past the start limit is one error naming the file and the import.

The samples here are instant and reward.timeout_s (1 s) is shorter than the import (2 s): a sample
charged with the import would time out. Outcomes are asserted, never elapsed times."""

from __future__ import annotations

import textwrap

import pytest

from megarl.config.sections import RewardConfig
from megarl.rewards import RewardScorer
from megarl.rewards import scorer as scorer_module
from megarl.rewards.scorer import RewardError

pytestmark = pytest.mark.timeout(300)

IMPORT_S = 2.0

SLOW_REWARDS = textwrap.dedent(
    """
    import os, time
    time.sleep({sleep_s})

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "exit":
            time.sleep(0.5)  # (pebble has read the worker's acknowledgement of this sample by then)
            os._exit(3)
        return float(solution_str == ground_truth)
    """
)


def _functions(tmp_path, sleep_s: float = IMPORT_S) -> dict[str, str]:
    path = tmp_path / "slow_rewards.py"
    path.write_text(SLOW_REWARDS.format(sleep_s=sleep_s))
    return {"slow": f"{path}:compute_score"}


def test_every_worker_imports_before_its_first_sample_which_is_not_timed_out(tmp_path):
    """Two workers: the start check loads the file in one; the other's import is no sample's."""
    cfg = RewardConfig(functions=_functions(tmp_path), workers=2, timeout_s=1.0)
    with RewardScorer(cfg) as scorer:
        result = scorer.score(["slow"] * 4, ["a", "b", "a", "a"], ["a"] * 4)
    assert (result.scores, result.errors, result.timeouts) == ([1.0, 0.0, 1.0, 1.0], 0, 0)


def test_the_replacement_of_a_worker_that_died_imports_outside_the_samples_timeouts(tmp_path):
    cfg = RewardConfig(functions=_functions(tmp_path), workers=1, timeout_s=1.0)
    with RewardScorer(cfg) as scorer:
        result = scorer.score(["slow"] * 3, ["exit", "a", "a"], ["a"] * 3)
    assert (result.scores, result.errors, result.deaths, result.timeouts) == ([0.0, 1.0, 1.0], 1, 1, 0)


def test_an_import_past_the_start_limit_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(scorer_module, "WORKER_START_TIMEOUT_S", 1.0)
    cfg = RewardConfig(functions=_functions(tmp_path, sleep_s=10**6), workers=1, timeout_s=1.0)
    with pytest.raises(RewardError) as info:
        RewardScorer(cfg)
    assert str(info.value) == ("reward.functions: importing 'slow_rewards.py' took more than 1 s in a reward worker; "
                               "check it for work done at import (network, locks, long loops)")


def test_a_replacements_start_limit_grows_with_the_import_measured(tmp_path, monkeypatch):
    """The bound on a worker's start is the longer of the setting and a few times the longest import."""
    cfg = RewardConfig(functions=_functions(tmp_path), workers=1, timeout_s=5.0)
    with RewardScorer(cfg) as scorer:  # the first start: under the default limit
        monkeypatch.setattr(scorer_module, "WORKER_START_TIMEOUT_S", 1.0)
        assert scorer._start_limit_s >= scorer_module.LOAD_BOUND_FACTOR * IMPORT_S
        result = scorer.score(["slow"] * 2, ["exit", "a"], ["a"] * 2)  # the replacement imports for 2 s > 1 s
    assert (result.scores, result.deaths, result.timeouts) == ([0.0, 1.0], 1, 0)
