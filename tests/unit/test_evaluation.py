"""megarl/evaluation.py against hand-computed values and brute-force enumeration."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from megarl.evaluation import (
    EvaluationError,
    as_metrics,
    default_ks,
    expected_best,
    expected_worst,
    pass_at_k,
    ragged_note,
    scored_responses,
    summarize,
)
from megarl.metrics import lookup


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k: every draw has a pass
    with pytest.raises(EvaluationError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


def _brute_force(scores: list[float], k: int, reduce) -> float:
    draws = list(itertools.product(scores, repeat=k))
    return sum(reduce(d) for d in draws) / len(draws)


@pytest.mark.parametrize("scores", [[0.0, 1.0], [0.0, 0.5, 1.0], [0.2, 0.2, 0.9, 0.4]])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_best_and_worst_of_k_equal_enumeration_of_draws_with_replacement(scores, k):
    assert expected_best(scores, k) == pytest.approx(_brute_force(scores, k, max))
    assert expected_worst(scores, k) == pytest.approx(_brute_force(scores, k, min))
    assert expected_best([0.0, 0.5, 1.0], 2) == pytest.approx(13 / 18)


def _maj_enumerated(scores: list[float], preds: list[str], k: int) -> float:
    total = 0.0
    draws = list(itertools.product(range(len(scores)), repeat=k))
    for picks in draws:
        counts = Counter(preds[i] for i in picks)
        winner = max(counts, key=counts.__getitem__)
        total += scores[next(i for i in picks if preds[i] == winner)]
    return total / len(draws)


def test_majority_vote_is_close_to_its_exact_value_and_needs_preds():
    scores, preds = [1.0, 1.0, 0.0, 0.0], ["7", "7", "5", "6"]
    rows = scored_responses(["d"] * 4, [0] * 4, scores, [3] * 4, ["stop"] * 4, pass_threshold=1.0, preds=preds)
    summary = summarize(rows)["d"]
    assert "maj@1" not in summary and "best@1" not in summary  # of one response: the mean
    for k in (2, 4):
        assert summary[f"maj@{k}"] == pytest.approx(_maj_enumerated(scores, preds, k), abs=0.05)
    without = scored_responses(["d"] * 4, [0] * 4, scores, [3] * 4, ["stop"] * 4, pass_threshold=1.0)
    assert not any(name.startswith("maj@") for name in summarize(without)["d"])


def test_responses_without_a_pred_vote_for_no_answer_and_maj_is_per_source():
    # An answer the function could not extract (pred None) must not drop maj@k of the whole run.
    scores, preds = [1.0, 1.0, 0.0, 0.0], ["7", "7", None, None]
    rows = scored_responses(["d"] * 4, [0] * 4, scores, [3] * 4, ["stop"] * 4, pass_threshold=1.0, preds=preds)
    summary = summarize(rows)
    for k in (2, 4):  # "no answer" is one more answer, as in verl
        assert summary["d"][f"maj@{k}"] == pytest.approx(_maj_enumerated(scores, ["7", "7", "-", "-"], k), abs=0.05)
    assert summary["all"]["maj@4"] == summary["d"]["maj@4"]
    # Source e's function gives no preds: maj@k for d only, and none for all (it would be d's alone).
    other = scored_responses(["e"] * 4, [1] * 4, [0.0, 1.0, 0.0, 1.0], [3] * 4, ["stop"] * 4, pass_threshold=1.0)
    mixed = summarize([*rows, *other])
    assert mixed["d"]["maj@4"] == summary["d"]["maj@4"]
    assert not any(name.startswith("maj@") for name in [*mixed["e"], *mixed["all"]])
    assert mixed["all"]["pass@4"] == pytest.approx(1.0) and mixed["all"]["best@2"] > 0
    # a pred that is no string (a number, a list of answers) votes by its text
    odd = scored_responses(["d"] * 4, [0] * 4, scores, [3] * 4, ["stop"] * 4, pass_threshold=1.0, preds=[[7], [7], 5, None])
    assert summarize(odd)["d"]["maj@4"] == pytest.approx(_maj_enumerated(scores, ["7", "7", "5", "-"], 4), abs=0.05)


def test_summary_per_source_and_overall():
    # source a: prompt 0 scores [1, 0], prompt 1 scores [0, 0]; source b: prompt 2 scores [1, 1]
    sources = ["a", "a", "a", "a", "b", "b"]
    prompts = [0, 0, 1, 1, 2, 2]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    lengths = [4, 8, 2, 6, 10, 10]
    reasons = ["stop", "length", "stop", "stop", "stop", "length"]
    summary = summarize(scored_responses(sources, prompts, scores, lengths, reasons, pass_threshold=1.0))
    assert list(summary) == ["all", "a", "b"]
    a, b, overall = summary["a"], summary["b"], summary["all"]
    assert a["prompts"] == 2 and a["responses"] == 4
    assert a["reward/mean"] == pytest.approx(0.25) and b["reward/mean"] == 1.0
    assert a["pass@1"] == pytest.approx((0.5 + 0.0) / 2) and a["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert a["best@2"] == pytest.approx((0.75 + 0.0) / 2) and a["worst@2"] == pytest.approx((0.25 + 0.0) / 2)
    assert overall["pass@2"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert a["response_length/mean"] == 5.0 and a["response_length/min"] == 2 and b["response_length/max"] == 10
    assert a["truncated_frac"] == 0.25 and overall["truncated_frac"] == pytest.approx(2 / 6)
    metrics = as_metrics(summary)
    assert metrics["val/pass@2"] == overall["pass@2"] and metrics["val/b/reward/mean"] == 1.0
    assert "val/prompts" not in metrics and all(lookup(name).emitter == "validation" for name in metrics)


def test_acc_decides_passing_where_a_reward_gives_it():
    rows = scored_responses(["d"] * 3, [0, 0, 0], [0.5, 0.5, 0.5], [1, 1, 1], ["stop"] * 3, pass_threshold=1.0,
                            acc=[1.0, math.nan, 0.0])  # fmt: skip
    assert [r.passed for r in rows] == [True, False, False]
    rows = scored_responses(["d"] * 2, [0, 0], [0.5, 0.2], [1, 1], ["stop"] * 2, pass_threshold=0.5)
    assert [r.passed for r in rows] == [True, False]


def test_k_beyond_the_responses_per_prompt_is_refused():
    rows = scored_responses(["d"] * 4, [0, 0, 1, 1], [1.0] * 4, [1] * 4, ["stop"] * 4, pass_threshold=1.0)
    with pytest.raises(EvaluationError, match=r"k 4 is not in 1..2: the prompt with the most responses has 2; use k <= 2"):
        summarize(rows, ks=[1, 4])
    assert default_ks(1) == [1] and default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]
    with pytest.raises(EvaluationError, match="no responses"):
        summarize([])


def test_ragged_prompts_keep_every_k_over_the_prompts_that_have_it():
    """One prompt with 4 responses (1 passing), one with 2 (both passing): pass@4 is the first's
    alone, pass@1 and pass@2 the mean of both, and the note says k 4 left a row out."""
    rows = scored_responses(["d"] * 6, [0, 0, 0, 0, 1, 1], [1.0, 0, 0, 0, 1.0, 1.0], [1] * 6, ["stop"] * 6,
                            pass_threshold=1.0)  # fmt: skip
    summary = summarize(rows)["d"]
    assert summary["pass@4"] == pytest.approx(1.0) and summary["best@4"] == pytest.approx(expected_best([1.0, 0, 0, 0], 4))
    assert summary["pass@1"] == pytest.approx((0.25 + 1.0) / 2) and summary["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert list(summary).index("pass@4") < list(summary).index("best@2")  # the fullest prompt's order of names
    note = ragged_note([4, 2])
    assert note is not None and "2 to 4 responses" in note and "(k=4: 1 of the 2 rows)" in note and "k=2" not in note
    assert ragged_note([4, 4]) is None and ragged_note([4, 2], ks=[1, 2]) is None
