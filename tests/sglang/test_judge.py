"""reward.judge.engine sglang: the LLM judge through its own real SGLang server on this CPU.

The judge is the demo's tiny model (its vocabulary is the task's digits, so the number parser reads
a score from whatever it says), greedy, in fp32: its scores through the server must be the torch
judge's on the same instructions. A call past its deadline is counted as timeouts of each of its
samples, its requests aborted on the server, which then judges again; closing the judge stops the
server.
"""

from __future__ import annotations

import pytest

from megarl.config.reward_sections import RewardJudgeConfig
from megarl.rewards.scorer import RewardError
from megarl.rollout.judge import start_judge

pytestmark = pytest.mark.sglang

PROMPTS, RESPONSES = ["123", "456", "789", "120"], ["321", "654", "000", "021"]


def test_the_judge_scores_through_its_own_sglang_server_as_the_torch_judge_does(sglang_python, tmp_path):
    from megarl.commands.demo import prepare_demo

    model, _ = prepare_demo(tmp_path / "demo")
    cfg = RewardJudgeConfig(model=str(model), engine="sglang", prompt_template="{prompt}={response}?", parser="number",
                            max_new_tokens=4, retries=0, max_running_requests=8)  # fmt: skip
    args = dict(in_process=True, log_dir=tmp_path / "logs", start_timeout_s=600, max_failed_fraction=1.0)
    reference = start_judge(cfg.model_copy(update={"engine": "torch"}), **args)
    try:
        expected = reference.score(PROMPTS, RESPONSES, RESPONSES, ["reverse_digits"] * 4)
    finally:
        reference.close()
    judge = start_judge(cfg, **args, server_python=sglang_python)
    server = judge.engines.engine.server
    try:
        scored = judge.score(PROMPTS, RESPONSES, RESPONSES, ["reverse_digits"] * 4)
        assert (scored.scores, scored.errors, scored.timeouts) == (expected.scores, expected.errors, expected.timeouts)
        assert scored.errors < len(PROMPTS)  # some output was read as a score
        judge.engines.timeout_s = 1e-3  # (the wrapper's deadline: reward.judge.timeout_s)
        with pytest.raises(RewardError, match=r"failed on 4 of 4 samples \(0 errors, 4 timeouts\)"):
            judge.score(PROMPTS, RESPONSES, RESPONSES, ["reverse_digits"] * 4)
        judge.engines.timeout_s = 300.0
        again = judge.score(PROMPTS, RESPONSES, RESPONSES, ["reverse_digits"] * 4)
        assert again.scores == expected.scores  # the late requests were aborted, the server judges again
    finally:
        judge.close()
    assert server.proc.poll() is not None  # stopped with the judge
    assert "sglang.launch_server" in (tmp_path / "logs" / "judge_sglang.log").read_text()
