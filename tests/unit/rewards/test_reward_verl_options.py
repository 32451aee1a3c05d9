"""verl's reward-manager options: qa_em (Search-R1), reward.format_score, user functions in
reward.functions, reward.num_examine."""

from __future__ import annotations

import logging
import textwrap

import pytest

from megarl.config.sections import RewardConfig
from megarl.rewards import RewardScorer, resolve
from megarl.rewards.registry import check_functions, score
from megarl.rewards.scorer import RewardError

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("response, truth, expected", [
    ("<think>..</think><answer> The Eiffel Tower! </answer>", {"target": ["eiffel tower"]}, 1.0),
    ("<answer>Paris</answer> then <answer>London</answer>", {"target": ["paris", "London"]}, 1.0),  # the last
    ("<answer>Paris</answer> then <answer>Rome</answer>", {"target": ["paris"]}, 0.0),
    ("<answer>\nan   apple\n</answer>", ["Apple"], 1.0),  # a list; articles, case and spaces normalised
    ("<answer>Apple</answer>", "the apple", 1.0),  # one answer as text
    ("The answer is Paris", {"target": ["Paris"]}, 0.0),  # no tag
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}, 0.25),  # spraying tags: a quarter, as verl
])  # fmt: skip
def test_qa_em_is_search_r1s_exact_match(response, truth, expected):
    assert score("qa_em", "searchR1_nq", response, truth) == expected
    assert resolve("searchR1_hotpotqa") == "qa_em"


def test_format_score_for_a_formatted_wrong_answer():
    assert RewardConfig().format_score == 0.0  # verl's default
    assert score("gsm8k", "openai/gsm8k", "#### 5", "4", format_score=0.1) == 0.1
    assert score("gsm8k", "openai/gsm8k", "the answer is 5", "4", format_score=0.1) == 0.0  # no format: 0
    assert score("gsm8k", "openai/gsm8k", "#### 4", "4", format_score=0.1) == 1.0
    assert score("qa_em", "q", "<answer>Rome</answer>", ["Paris"], format_score=0.2) == 0.2
    assert score("qa_em", "q", "Rome", ["Paris"], format_score=0.2) == 0.0


USER = textwrap.dedent(
    """
    def by_length(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str) >= extra_info["reward_model"]["min_len"]) + (ground_truth == [1, 2])
    """
)


def test_reward_functions_name_user_functions_and_check_them(tmp_path):
    file = tmp_path / "mine.py"
    file.write_text(USER)
    assert resolve("my_task", {"my_task": f"{file}:by_length"}) == f"{file}:by_length"
    with pytest.raises(ValueError, match=r"reward.functions\['t'\] = '.*nope.py:f': .*nope.py is not a file"):
        check_functions({"t": f"{tmp_path}/nope.py:f"})
    with pytest.raises(ValueError, match=r"your own function as path/to/file.py:function"):
        check_functions({"t": "gsm9k"})


def test_user_functions_format_score_and_num_examine_in_the_pool(tmp_path, caplog):
    file = tmp_path / "mine.py"
    file.write_text(USER)
    cfg = RewardConfig(functions={"my_task": f"{file}:by_length"}, format_score=0.25, num_examine=1, workers=1, timeout_s=20)
    with caplog.at_level(logging.INFO, logger="megarl.rewards.scorer"), RewardScorer(cfg, start_method="spawn") as scorer:
        result = scorer.score(
            ["my_task", "my_task", "openai/gsm8k", "openai/gsm8k"], ["long enough", "x", "#### 3", "#### 4"],
            [[1, 2], None, "4", "4"], [{"reward_model": {"min_len": 3}}, {"reward_model": {"min_len": 3}}, None, None],
            prompts=["p0", "p1", "p2", "p3"],
        )
    assert result.scores == [2.0, 0.0, 0.25, 1.0] and result.errors == 0
    shown = [r.getMessage() for r in caplog.records if "[response]" in r.getMessage()]
    assert len(shown) == 2  # one per data source
    assert "[prompt] p0\n[response] long enough\n[ground_truth] [1, 2]\n[score] 2" in shown[0]
    assert "[response] #### 3" in shown[1]


def test_a_user_function_that_does_not_load_stops_the_scorer_at_start(tmp_path):
    file = tmp_path / "mine.py"
    file.write_text(USER)
    cfg = RewardConfig(functions={"my_task": f"{file}:typo"}, workers=1)
    with pytest.raises(RewardError, match=r"reward.functions\['my_task'\] = .*:typo' failed to load in a reward worker: "
                                          r"AttributeError: .*'typo' is not a function .*functions defined there: by_length"):
        RewardScorer(cfg, start_method="spawn")
