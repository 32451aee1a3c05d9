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
    server = judge.engines.engine.engines[0].server  # its one server on CPU, a child of this process
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


def test_a_demo_run_scores_the_rule_and_the_sglang_judge_combined(sglang_python, tmp_path):
    """`megarl launch --in-process` of the demo for 2 steps, each sample scored by its rule and the
    judge through its SGLang server (reward.combine): both components logged, the server gone after."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    from megarl.commands.demo import prepare_demo

    root = Path(__file__).resolve().parents[2]
    model, data = prepare_demo(tmp_path / "demo")
    out = tmp_path / "run"
    overrides = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
                 "cluster.gpus_per_node=1", "trainer.total_steps=2", "trainer.eval_freq=0", "trainer.eval_before_train=false",
                 "trainer.save_freq=0", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}", "data.prompts_per_step=4",
                 "actor.mini_batch_size=16", "actor.micro_batch_size=8", f"rollout.server_python={sglang_python}",
                 "reward.combine={reverse_digits: {reverse_digits: 1.0, judge: 0.5}}", f"reward.judge.model={model}",
                 "reward.judge.engine=sglang", "reward.judge.prompt_template='{prompt}={response}?'", "reward.judge.parser=number",
                 "reward.judge.max_new_tokens=4", "reward.max_failed_fraction=1.0"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "megarl.cli", "launch", "configs/tiny_grpo.yaml", "--in-process", *overrides],
                          cwd=root, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"reward/reverse_digits", "reward/judge", "reward/judge_errors", "reward/judge_timeouts"} <= set(r)
        assert r["reward/judge_timeouts"] == 0
    assert (out / "logs" / "judge_sglang.log").is_file()
    servers = [p for p in psutil.process_iter(["cmdline"]) if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
               and str(model) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert servers == []  # stopped with the run
