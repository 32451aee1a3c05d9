"""RewardScorer: the worker pool, per-sample timeouts, crashes, custom functions (contract)."""

import glob
import logging
import math
import os
import pathlib
import tempfile
import textwrap
import uuid

import pytest

from megarl.config.sections import CustomRewardConfig, RewardConfig, RewardModelConfig
from megarl.rewards import RewardScorer
from megarl.rewards.scorer import RewardError

# A test that hangs fails here rather than hold the run for the suite's 900 s; the tests assert
# outcomes, never elapsed times (they fail under load).
pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 2.0  # generous: fast samples must never hit it on a loaded 2-core machine
USER_REWARDS = textwrap.dedent(
    """
    import ctypes, os, pathlib, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise RuntimeError("boom from user code")
        if solution_str == "sleep":  # leaves its worker's pid beside this file
            pathlib.Path(__file__).with_name(f"sleeping-{os.getpid()}").touch()
            time.sleep(60)
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "segfault":
            ctypes.string_at(0)
        if solution_str == "dict":
            return {"score": 0.5, "length": len(ground_truth), "label": "not a number", "pred": 42}
        if solution_str == "pause":
            time.sleep(0.3)
            return 1.0
        if solution_str == "nan":
            return float("nan")
        return float(solution_str == ground_truth)

    def compute_batch(data_sources, solution_strs, ground_truths, extra_infos):
        if "raise" in solution_strs:
            raise ValueError("batch boom")
        if "short" in solution_strs:
            return [1.0]
        return [{"score": float(s == g), "position": i} for i, (s, g) in enumerate(zip(solution_strs, ground_truths))]
    """
)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_rewards") / "my_reward.py"
    path.write_text(USER_REWARDS)
    return str(path)


@pytest.fixture(scope="module")
def custom_scorer(user_file):
    cfg = RewardConfig(custom=CustomRewardConfig(path=user_file), timeout_s=TIMEOUT_S, workers=2)
    with RewardScorer(cfg) as scorer:
        yield scorer


def _score(scorer, solutions, truths=None):
    truths = truths or ["a"] * len(solutions)
    return scorer.score(["any"] * len(solutions), solutions, truths, [None] * len(solutions))


def test_a_caller_is_told_of_the_samples_as_they_are_scored(custom_scorer):
    """`megarl evaluate`'s progress display moves within a call (it showed 0 until the call ended)."""
    told: list[int] = []
    solutions = ["pause"] * 6 + ["raise"]  # a sample that failed is done too
    result = custom_scorer.score(["any"] * 7, solutions, ["a"] * 7, [None] * 7, on_scored=told.append)
    assert sum(told) == 7 and len(told) >= 2 and all(n > 0 for n in told), told  # 2 workers: samples end in turns
    assert result.scores == [1.0] * 6 + [0.0]


def test_custom_scores_errors_and_extras(custom_scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        result = _score(
            custom_scorer, ["a", "b", "raise", "dict", "nan"], ["a", "a", "a", "xyz", "a"]
        )
    assert result.scores == [1.0, 0.0, 0.0, 0.5, 0.0]
    assert (result.errors, result.timeouts) == (2, 0)  # the raise and the NaN score
    assert list(result.extra) == ["length"]  # non-numeric extras are dropped
    assert result.preds == [None, None, None, "42", None]  # "pred" is kept as text (maj@k)
    assert result.extra["length"][3] == 3.0 and math.isnan(result.extra["length"][0])
    assert (
        "boom from user code" in caplog.text and "'raise'" in caplog.text
    )  # logged with the sample
    metrics = result.metrics()
    assert metrics["reward/errors"] == 2.0 and metrics["reward/length"] == 3.0
    assert metrics["reward/score_mean"] == pytest.approx(1.5 / 5)


def test_timeout_scores_zero_and_stops_the_sample(custom_scorer, user_file, still_running):
    result = _score(custom_scorer, ["a", "sleep", "a", "b"])
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert (result.errors, result.timeouts) == (0, 1)  # a timeout, not the 0.0 the sleep returns after 60 s
    sleepers = {int(p.name.split("-")[1]) for p in pathlib.Path(user_file).parent.glob("sleeping-*")}
    assert len(sleepers) == 1 and not still_running(sleepers)  # the sleep was cut: its worker is gone
    assert _score(custom_scorer, ["a"]).scores == [1.0]  # the replaced worker serves the next call


@pytest.mark.parametrize("crash", ["exit", "segfault"])
def test_worker_crash_is_an_error_and_the_pool_survives(custom_scorer, crash, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        result = _score(custom_scorer, ["a", crash, "a"])
    assert result.scores == [1.0, 0.0, 1.0]
    assert (result.errors, result.timeouts) == (1, 0)
    assert "the worker process died (exit code " in caplog.text
    assert _score(custom_scorer, ["a", "a", "b"]).scores == [1.0, 1.0, 0.0]


def test_batched_custom_function(user_file):
    cfg = RewardConfig(
        custom=CustomRewardConfig(path=user_file, name="compute_batch", batched=True),
        timeout_s=TIMEOUT_S,
    )
    with RewardScorer(cfg) as scorer:
        result = _score(scorer, ["a", "b", "a"])
        assert result.scores == [1.0, 0.0, 1.0] and result.extra == {"position": [0.0, 1.0, 2.0]}
        # The call raised: every sample of it failed, so the run stops with the function's traceback.
        with pytest.raises(RewardError, match=r"(?s)failed on 2 of 2 samples.*batch boom.*Traceback.*my_reward.py") as raised:
            _score(scorer, ["a", "raise"])
        assert "pebble" not in str(raised.value) and "worker.py" not in str(raised.value)  # the user's frames only
        # Wrong length: an error, not a misalignment, in one line (megarl's check has no traceback to show).
        with pytest.raises(RewardError, match=r"returned a list of 1 \(\[1.0\]\) for 2 samples") as raised:
            _score(scorer, ["a", "short"])
        assert "\n" not in str(raised.value)


def test_custom_config_errors_name_field_and_fix(user_file, tmp_path):
    # Loading the function fails in a worker: a RewardError (a user error, one line at the CLI).
    with pytest.raises(RewardError, match="reward.custom.path"):
        RewardScorer(RewardConfig(custom=CustomRewardConfig(path=str(tmp_path / "missing.py"))))
    with pytest.raises(RewardError, match="compute_batch, compute_score"):
        RewardScorer(RewardConfig(custom=CustomRewardConfig(path=user_file, name="score_it")))
    both = RewardConfig(
        custom=CustomRewardConfig(path=user_file), model=RewardModelConfig(path=str(tmp_path))
    )
    with pytest.raises(ValueError, match="set one of them"):
        RewardScorer(both)
    with pytest.raises(ValueError, match="not a built-in scorer"):
        RewardScorer(RewardConfig(functions={"my/data": "gsm9k"}))


@pytest.fixture(scope="module")
def builtin_scorer():
    # spawn here (the custom pool uses the default forkserver): both contexts are exercised.
    cfg = RewardConfig(functions={"my/arith": "gsm8k_flexible"}, timeout_s=TIMEOUT_S, workers=2)
    with RewardScorer(cfg, start_method="spawn") as scorer:
        yield scorer


def test_builtin_scorers_in_the_pool(builtin_scorer):
    sources = ["openai/gsm8k", "my/arith", "lighteval/MATH", "reverse_digits", "code"]
    solutions = ["#### 7", "it is 7", "\\boxed{\\frac{1}{2}}", "321", "```python\nprint(7)\n```"]
    truths = ["7", "7", "0.5", "321", None]
    infos = [None, None, None, None, {"tests": [{"input": "", "output": "7"}]}]
    result = builtin_scorer.score(sources, solutions, truths, infos)
    assert result.scores == [1.0] * 5 and (result.errors, result.timeouts) == (0, 0)


def test_hanging_sample_in_a_chunk_gets_its_own_timeout(builtin_scorer):
    # 9^(9^(9^9)) makes sympy compute a huge integer in C: only killing the worker stops it.
    solutions = ["\\boxed{2}"] * 6 + ["\\boxed{9^{9^{9^{9}}}}"] + ["\\boxed{3}"] * 5
    result = builtin_scorer.score(["math"] * 12, solutions, ["2"] * 12)
    assert result.scores == [1.0] * 6 + [0.0] * 6
    assert (result.errors, result.timeouts) == (0, 1)


def test_input_errors_raise_before_scoring(builtin_scorer):
    with pytest.raises(ValueError, match="reward.functions"):
        builtin_scorer.score(["unknown/source"], ["x"], ["y"])
    with pytest.raises(ValueError, match="ground_truths"):
        builtin_scorer.score(["gsm8k", "gsm8k"], ["#### 1", "#### 2"], ["1"])
    assert builtin_scorer.score([], [], []).scores == []


def test_timed_out_code_sample_leaves_no_program_or_directory(builtin_scorer):
    marker = f"marker_{uuid.uuid4().hex}"
    program = f"```python\nimport time\nopen({marker!r}, 'w').write('x')\nwhile True:\n    time.sleep(0.01)\n```"
    info = {"tests": [{"input": "", "output": "never"}], "time_limit_s": 30}  # > reward timeout
    result = builtin_scorer.score(["code", "reverse_digits"], [program, "321"], [None, "321"], [info, None])
    assert (result.scores, result.timeouts) == ([0.0, 1.0], 1)
    # pebble reports the timeout once it has stopped (and joined) the worker: its SIGTERM handler
    # has killed the run and cleaned up by now, or never will.
    assert not _sandboxes_with(marker)


def _sandboxes_with(marker: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "megarl-sandbox-*", marker))
