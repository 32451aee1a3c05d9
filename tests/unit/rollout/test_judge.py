"""reward.judge and reward.combine: the parsers on hand-written outputs, the template check, and the
demo's tiny model as a judge in this process (its outputs are digits: the number parser reads them,
the verdict parser reads nothing, which is counted and stops the call past max_failed_fraction)."""

from __future__ import annotations

import math

import pytest

from megarl.config.reward_sections import RewardJudgeConfig
from megarl.config.sections import RewardConfig
from megarl.rewards.judge_prompt import JudgeOutputError, parse_score, render, template_problem
from megarl.rewards.scorer import RewardError

VERDICTS = {"correct": 1.0, "incorrect": 0.0}


def test_parsers_read_the_last_score_and_refuse_outputs_without_one():
    assert parse_score("I give 3, no: 7.5", "number", VERDICTS) == 7.5
    assert parse_score(r"so \boxed{0.25} and not \boxed{x} ... \boxed{ 1 }", "boxed", VERDICTS) == 1.0
    assert parse_score("Not correct. Verdict: INCORRECT", "verdict", VERDICTS) == 0.0  # the last, whole words
    assert parse_score("incorrectly... correct", "verdict", VERDICTS) == 1.0
    for text, parser in (("none here", "number"), (r"\boxed{seven}", "boxed"), ("incorrectly so", "verdict")):
        with pytest.raises(JudgeOutputError):
            parse_score(text, parser, VERDICTS)
    # a score that is not finite is no score: it would poison every advantage of the step
    for text, parser in (("rating 1e400", "number"), (r"\boxed{inf}", "boxed"), (r"\boxed{nan}", "boxed")):
        with pytest.raises(JudgeOutputError, match="not a finite number"):
            parse_score(text, parser, VERDICTS)


def test_template_placeholders_are_checked_and_rendered():
    assert template_problem("Q: {prompt}\nA: {response}\nRef: {ground_truth}\n\\boxed{{}}") is None
    assert "unknown placeholder {answer}" in template_problem("{prompt} {answer}")
    assert "literal brace twice" in template_problem(r"\boxed{")
    messages = [{"role": "user", "content": "2+2?"}]
    assert render("{prompt}|{response}|{ground_truth}", messages, "4", 4) == "2+2?|4|4"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from megarl.commands.demo import prepare_demo

    model, _ = prepare_demo(tmp_path_factory.mktemp("demo"))
    return str(model)


def _judge(model: str, **kw):
    from megarl.rollout.judge import start_judge

    cfg = RewardJudgeConfig(model=model, prompt_template="{prompt}={response}?", max_new_tokens=4, **kw)
    return start_judge(cfg, in_process=True, log_dir=".", start_timeout_s=60, max_failed_fraction=1.0)


def test_a_judge_that_returns_garbage_or_hangs_is_counted_and_stops_the_call(demo_model):
    judge = _judge(demo_model, parser="number")
    try:
        scored = judge.score(["123", "456", "789"], ["321", "654", "987"], ["321"] * 3, ["reverse_digits"] * 3)
        assert scored.errors + scored.timeouts < 3 and len(scored.scores) == 3
        judge.cfg = judge.cfg.model_copy(update={"parser": "verdict"})  # digits hold no verdict word
        with pytest.raises(RewardError, match=r"reward.judge failed on 2 of 2 samples \(2 errors, 0 timeouts\).*none of the verdicts"):
            judge.score(["123", "456"], ["321", "654"], ["321"] * 2, ["reverse_digits"] * 2)
    finally:
        judge.close()
    hung = _judge(demo_model, parser="number", timeout_s=1e-4, retries=0)
    try:
        with pytest.raises(RewardError, match=r"2 timeouts\).*raise reward.judge.timeout_s"):
            hung.score(["123", "456"], ["321", "654"], ["321"] * 2, ["reverse_digits"] * 2)
    finally:
        hung.close()


def test_combined_scores_sum_the_rule_and_the_judge(demo_model):
    from megarl.rollout.judge import start_judge
    from megarl.rollout.reward_combine import CombinedScorer

    judge_cfg = RewardJudgeConfig(model=demo_model, prompt_template="{prompt}{response}", parser="number", max_new_tokens=3)
    cfg = RewardConfig(workers=1, combine={"reverse_digits": {"reverse_digits": 1.0, "judge": 0.001}}, judge=judge_cfg)
    judge = start_judge(judge_cfg, in_process=True, log_dir=".", start_timeout_s=60, max_failed_fraction=1.0)
    with CombinedScorer(cfg, judge) as scorer:
        result = scorer.score(["reverse_digits"] * 2 + ["gsm8k"], ["321", "999", "#### 4"], ["321", "654", "4"],
                              prompts=["123", "456", "2+2?"])
    rule, verdict = result.extra["reverse_digits"], result.extra["judge"]
    assert rule[0] == 1.0 and rule[1] < 1.0 and math.isnan(rule[2])  # gsm8k is not combined: its own scorer
    assert math.isnan(verdict[2])
    for i in range(2):
        assert result.scores[i] == pytest.approx(rule[i] + 0.001 * verdict[i])
    assert result.scores[2] == 1.0
    metrics = result.metrics()
    assert metrics["reward/reverse_digits"] == pytest.approx((rule[0] + rule[1]) / 2) and "reward/judge" in metrics
    assert metrics["reward/judge_errors"] + metrics["reward/judge_timeouts"] == result.judge_errors + result.judge_timeouts


def test_the_sglang_judges_server_gets_the_judges_own_arguments(tmp_path):
    from megarl.rollout.judge_server import judge_server_spec
    from megarl.rollout_sglang.server import build_launch_command

    cfg = RewardJudgeConfig(model=str(tmp_path), prompt_template="{response}", engine="sglang", mem_fraction=0.1,
                            max_running_requests=4)  # fmt: skip
    spec = judge_server_spec(cfg, 8192, tmp_path / "judge_sglang.log", "/venv/bin/python")
    command = " ".join(build_launch_command(spec, 1234))
    assert command.startswith(f"/venv/bin/python -m sglang.launch_server --model-path {tmp_path} ")
    for flag in ("--mem-fraction-static 0.1", "--device cpu", "--max-running-requests 4", "--max-total-tokens 8192",
                 "--context-length 8192"):  # fmt: skip
        assert flag in command
    assert spec.die_with_parent and spec.log_path == str(tmp_path / "judge_sglang.log")
