"""The CPU tool-use demo (configs/tiny_tool_agent.yaml, docs/agents.md) for two GRPO steps: the
real trainer in one process (Megatron policy, torch engine, weight pushes, reward pool) with the
tool_agent loop, the compact call parser and the built-in calculator, on the demo's random-init
model and its add-two-numbers data.

Read token by token, independently of the loop: every turn whose call is a sum of numbers is
followed by the calculator's answer (the sum, computed here) as context tokens, which carry no
loss, while every token the model wrote does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_tool_agent.yaml"
_SUM = re.compile(r"(0|[1-9][0-9]*)(\+(0|[1-9][0-9]*))*")  # what Python's grammar reads as a sum of ints


def _run(rank: int, world: int, root: str) -> dict:
    from megarl.commands.demo import prepare_demo
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown

    model, data = prepare_demo(Path(root) / "demo", arch="tiny-tool-demo")
    cfg = load_config(CONFIG, [
        f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", "data.val_files=[]",
        f"trainer.output_dir={Path(root) / 'run'}", "trainer.total_steps=2", "trainer.eval_before_train=false",
        "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.loggers=[jsonl]", "cluster.gpus_per_node=1",
        "data.prompts_per_step=16", "actor.mini_batch_size=128", "reward.workers=1",
        f"rollout.agent.tools_file={ROOT / 'configs' / 'tools' / 'calculator.yaml'}",
    ])  # fmt: skip
    trainer = build_trainer(cfg, make_plan(cfg, check_files=True, in_process=True), in_process=True)
    batches = []
    collect = trainer.parts.rollouts.collector.collect

    def keep(*args, **kwargs):  # the step's scored batch, as the trainer received it
        batch, metrics = collect(*args, **kwargs)
        batches.append(batch)
        return batch, metrics

    trainer.parts.rollouts.collector.collect = keep
    try:
        trainer.fit()
    finally:
        shutdown(trainer)
    rows = [(ids[:n], mask[:n], info["agent"]) for b in batches for ids, mask, n, info in
            zip(b.response_ids.tolist(), b.response_mask.tolist(), b.response_lengths.tolist(), b.extra_info)]  # fmt: skip
    return {"model": str(model), "rows": rows, "steps": len(batches), "turn_cap": cfg.rollout.agent.max_tokens_per_turn}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_distributed(_run, 1, str(tmp_path_factory.mktemp("tool-demo")), timeout_s=600, daemon=False)[0]


def _checked_calls(ids: list[int], mask: list[int], tok, turn_cap: int) -> int:
    """Walk one trajectory turn by turn; returns how many tool answers were checked."""
    from megarl.rollout.agents.compact_calls import calculator_calls

    eos, checked, pos = tok.convert_tokens_to_ids("<|im_end|>"), 0, 0
    while pos < len(ids):
        end = next((i + 1 for i in range(pos, min(pos + turn_cap, len(ids))) if ids[i] == eos), min(pos + turn_cap, len(ids)))
        assert all(m == 1 for m in mask[pos:end]), "a token the model wrote carries no loss"
        items = calculator_calls(tok.decode(ids[pos:end], skip_special_tokens=False)).items
        expression = items[0].arguments["expression"] if len(items) == 1 and not isinstance(items[0], str) else ""
        if end == len(ids) or not _SUM.fullmatch(expression):
            return checked  # no call, or one whose answer this walk does not predict: the rest is not read
        closing = "" if ids[end - 1] == eos else "<|im_end|>"  # a turn cut at turn_cap is closed by the template
        answer = tok.encode(f"{closing}<|im_start|>{sum(int(x) for x in expression.split('+'))}<|im_end|><|im_start|>")
        assert ids[end : end + len(answer)] == answer, f"the answer to {expression!r} is not the calculator's"
        assert all(m == 0 for m in mask[end : end + len(answer)]), "the tool's answer is trained on"
        checked, pos = checked + 1, end + len(answer)
    return checked


def test_the_tool_answers_sums_as_context_and_only_the_model_tokens_are_trained(run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run["model"])
    assert run["steps"] == 2
    checked = [_checked_calls(ids, mask, tok, run["turn_cap"]) for ids, mask, _ in run["rows"]]
    assert sum(checked) >= 2  # the random-init policy already writes a few sums between the markers
    for count, (_, mask, agent) in zip(checked, run["rows"]):
        assert agent["tool_calls"] - agent["tool_failures"] >= count  # each checked answer was a call that ran
        if agent["tool_calls"] == 0:
            assert all(m == 1 for m in mask)  # a trajectory without a call is all the model's
