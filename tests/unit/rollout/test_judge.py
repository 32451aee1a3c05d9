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


def test_the_judges_gpu_servers_get_their_bundles_gpus_and_the_judges_arguments(tmp_path):
    """cluster.device cuda: server k on the plan's devices k * tp ..., held by the judge placement's
    bundles (Ray's probes list them out of order here), its GPUs as CUDA_VISIBLE_DEVICES, listening
    on its node's address, the judge's tp, mem fraction (0.8 when unset on cuda), context length."""
    from megarl.rollout.judge_server import judge_server_specs
    from megarl.rollout_sglang.server import build_launch_command, build_launch_env

    cfg = RewardJudgeConfig(model=str(tmp_path), prompt_template="{response}", engine="sglang", gpus=4, tp=2,
                            max_running_requests=32)  # fmt: skip
    bundles = [{"ip": "10.0.0.3", "node_id": "node3", "gpu_ids": [str(g)]} for g in (6, 7, 4, 5)]
    slots, specs = judge_server_specs(cfg, (4, 5, 6, 7), bundles, 2048, tmp_path / "logs", "/venv/bin/python")
    assert [(s.index, s.node_id, s.gpu_ids, s.holders) for s in slots] == [(0, "node3", ("6", "7"), (0, 1)),
                                                                           (1, "node3", ("4", "5"), (2, 3))]  # fmt: skip
    for k, spec in enumerate(specs):
        command = build_launch_command(spec, 30000 + k)
        flags = " ".join(command)
        for flag in ("--tp-size 2", "--mem-fraction-static 0.8", "--max-running-requests 32", "--context-length 2048",
                     f"--host 10.0.0.3 --port {30000 + k}", "--base-gpu-id 0"):  # fmt: skip
            assert flag in flags
        assert command[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"] and "--device" not in command
        # its devices for the whole run: no memory saver, no CPU-sized token pool, SGLang sizes its KV from mem_fraction
        assert "--enable-memory-saver" not in command and "--max-total-tokens" not in command
        assert build_launch_env(spec, {})["CUDA_VISIBLE_DEVICES"] == ",".join(slots[k].gpu_ids)
        assert spec.log_path == str(tmp_path / "logs" / f"judge_sglang{k}.log") and spec.port == 0  # a free port at launch
    # a server whose bundles Ray put on two nodes is refused, naming the judge's key
    split = [{"ip": f"10.0.0.{n}", "node_id": f"node{n}", "gpu_ids": ["0"]} for n in (1, 2, 1, 2)]
    with pytest.raises(ValueError, match=r"engine 0 .* would span 2 nodes; reward.judge.tp \(2\) must fit in one node"):
        judge_server_specs(cfg, (4, 5, 6, 7), split, 2048, tmp_path, None)


def test_the_judges_server_stops_even_when_its_clients_close_fails(tmp_path):
    import subprocess
    import sys

    from megarl.rollout.judge_server import JudgeServers, judge_server_spec
    from megarl.rollout_sglang.engine import SGLangEngine
    from megarl.rollout_sglang.server import SGLangServer

    cfg = RewardJudgeConfig(model=str(tmp_path), prompt_template="{response}", engine="sglang")
    server = SGLangServer(judge_server_spec(cfg, 4096, tmp_path / "judge_sglang.log", None))
    # A stand-in process for the server (no SGLang here): what close must stop.
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    engine = SGLangEngine(server)
    judge_server = JudgeServers([engine], server.shutdown)
    engine._background_pool = object()  # its close now raises AttributeError
    try:
        with pytest.raises(AttributeError):
            judge_server.close()
        assert server.proc.poll() is not None
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_the_shared_workers_log_outlives_every_pool_of_a_combined_scorer(tmp_path):
    """Every pool of reward.combine writes to one log: closing the first pool must not remove it
    under the others; the combined scorer removes it, empty, once all are closed."""
    from megarl.config.sections import CustomRewardConfig
    from megarl.rollout.reward_combine import CombinedScorer

    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = RewardConfig(workers=1, custom=CustomRewardConfig(path=str(reward), name="score"),
                       combine={"reverse_digits": {"reverse_digits": 1.0, "custom": 1.0}})  # fmt: skip
    log_path = tmp_path / "reward_workers.log"
    scorer = CombinedScorer(cfg, log_path=log_path)
    try:
        assert set(scorer.pools) == {"rules", "custom"}
        scorer.pools["rules"].close()  # the pool that made the log closes first
        assert log_path.exists()  # the custom pool's workers still write to it
    finally:
        scorer.close()
    assert not log_path.exists()  # no worker wrote to it: removed by its owner


def test_a_sample_scored_by_several_components_reports_one_components_pred_and_extras(tmp_path):
    """Two components of one data source: pred and extras (acc: val/acc) come from its reporter, the
    data source's own rule scorer when listed, else its first-listed component; never from whichever
    pool merged last."""
    from megarl.config.sections import CustomRewardConfig
    from megarl.rollout.reward_combine import CombinedScorer, reporter

    rules = RewardConfig(combine={"gsm8k": {"math": 0.5, "gsm8k": 1.0}, "mine": {"math": 1.0, "gsm8k": 1.0}})
    assert reporter(rules, "gsm8k", rules.combine["gsm8k"]) == "gsm8k"  # its own scorer, though listed second
    assert reporter(rules, "mine", rules.combine["mine"]) == "math"  # no scorer of its own: the first listed
    assert reporter(rules, "mine", {"judge": 1.0}) is None
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0, 'acc': 0.25, 'pred': 'custom'}\n")  # fmt: skip
    custom = CustomRewardConfig(path=str(reward), name="score")
    for parts, pred in (({"reverse_digits": 1.0, "custom": 1.0}, None), ({"custom": 1.0, "gsm8k_flexible": 1.0}, "custom")):
        cfg = RewardConfig(workers=1, custom=custom, combine={"reverse_digits": parts})
        with CombinedScorer(cfg) as scorer:
            result = scorer.score(["reverse_digits"], ["321"], ["321"])
        assert result.preds == [pred], parts
        assert ("acc" in result.extra) == (pred is not None), parts


def test_a_timeout_is_not_retried_on_an_engine_that_cannot_stop_the_late_call(demo_model):
    """An engine that cannot stop a late call (the torch engine's actor: retries_timeouts False)
    would queue a retry behind it, so its timed-out samples are counted at once, in one call."""
    from megarl.rollout.judge import Judge

    judge = _judge(demo_model, parser="number", timeout_s=1e-4, retries=2)
    engine = judge.engines.engine
    calls = []
    real_generate = engine.generate

    def counted(prompts, params):  # the real engine's generate, counted
        calls.append(len(prompts))
        return real_generate(prompts, params)

    engine.generate = counted
    try:
        assert judge.retries_timeouts  # in this process: stopped at its next step, so retried
        unstoppable = Judge(judge.cfg, judge.engines, judge.tokenizer, 64, retries_timeouts=False)
        with pytest.raises(RewardError, match=r"2 timeouts\)"):
            unstoppable.score(["123", "456"], ["321", "654"], ["321"] * 2, ["reverse_digits"] * 2)
        assert calls == [2]
    finally:
        judge.close()


# Times out on a generate far longer than the exit, which records (in a file) when it ends whole.
_LATE_CALL_AT_EXIT = """
import sys
from pathlib import Path
from megarl.engines.base import SamplingParams
from megarl.engines.torch_engine import TorchEngine
from megarl.rollout.judge import _WithDeadline

engine = TorchEngine(sys.argv[1], device="cpu")
real_generate = engine.generate

def generate(prompts, params):
    out = real_generate(prompts, params)
    Path(sys.argv[2]).write_text("the late call ended")
    return out

engine.generate = generate
timed = _WithDeadline(engine, 0.05)
engine.step_hook = timed.stop_if_late  # as start_judge sets it
try:
    timed.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=4000, ignore_eos=True))
except TimeoutError:
    timed.close()
    print("timed out")
"""


def test_a_late_torch_judge_call_does_not_hold_up_the_interpreters_exit(demo_model, tmp_path):
    import subprocess
    import sys

    script, marker = tmp_path / "late.py", tmp_path / "ended"
    script.write_text(_LATE_CALL_AT_EXIT)
    done = subprocess.run([sys.executable, str(script), demo_model, str(marker)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0 and "timed out" in done.stdout, done.stderr[-2000:]
    assert not marker.exists()  # the late generate was stopped, not waited for to its end


def test_combine_weights_are_numbers_not_text_that_reads_as_one():
    """"0.5" (quoted) was turned into 0.5; 1e-3 is text to YAML 1.1 (the message says how to write it)."""
    from pathlib import Path

    from megarl.config.loading import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
    for weight in ('"0.5"', "1e-3", "true"):
        with pytest.raises(ConfigError, match=r"reward.combine\['gsm8k'\]\['gsm8k'\] = .* is (str|bool), not a number; "
                                              r"write the weight unquoted"):  # fmt: skip
            load_config(tiny, [f"reward.combine={{gsm8k: {{gsm8k: {weight}}}}}"])
    assert RewardConfig(combine={"gsm8k": {"gsm8k": 1, "math": 0.5}}).combine == {"gsm8k": {"gsm8k": 1.0, "math": 0.5}}


def test_a_score_outside_the_range_counts_as_no_score():
    """A judge asked for 0-10 that answers "42" (or a year from the response) scores like garbage:
    the output is retried, then counted as a failure, not used as a reward 4x the scale."""
    assert parse_score("score: 7", "number", VERDICTS, (0.0, 10.0)) == 7.0
    assert parse_score(r"\boxed{10}", "boxed", VERDICTS, (0.0, 10.0)) == 10.0  # the ends count
    for text, parser in (("I'd say 42", "number"), (r"\boxed{-1}", "boxed")):
        with pytest.raises(JudgeOutputError, match=r"is outside reward.judge.score_range \[0, 10\]"):
            parse_score(text, parser, VERDICTS, (0.0, 10.0))
    assert parse_score("I'd say 42", "number", VERDICTS) == 42.0  # without a range: any finite number
    with pytest.raises(ValueError, match="is for parser number or boxed"):
        RewardJudgeConfig(model="m", prompt_template="{response}", score_range=(0, 1))
    with pytest.raises(ValueError, match=r"give \[low, high\], finite, low < high"):
        RewardJudgeConfig(model="m", prompt_template="{response}", parser="number", score_range=(10, 0))
