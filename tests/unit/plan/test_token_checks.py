"""Data the model cannot write is refused before launch: `megarl data gsm8k --tools` data on the
demo model (whose tokenizer keeps digits only) passed the plan and trained at reward 0."""

from __future__ import annotations

from pathlib import Path

from megarl.cli import main
from megarl.config.loading import load_config
from megarl.data.datasets import check_prompt_file, file_label
from megarl.data.tasks import TASK_VOCAB
from megarl.data.tool_sums import CALL_MARKERS, TOOL_SUM_VOCAB, write_tool_sums
from megarl.models.tiny import build_tokenizer
from megarl.plan.issues import Finding
from megarl.plan.preflight import preflight
from megarl.plan.token_checks import check_answers, check_tool_calls, round_trip

ROOT = Path(__file__).resolve().parents[3]
GSM8K = ['{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\\n#### 7"}',
         '{"question": "What is 2 times 6?", "answer": "2*6=12\\n#### 12"}']  # fmt: skip


def gsm8k_file(tmp_path: Path, *flags: str) -> Path:
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(GSM8K) + "\n")
    out = tmp_path / f"gsm8k{''.join(flags)}.parquet"
    assert main(["data", "gsm8k", *flags, str(tmp_path / "gsm8k.jsonl"), str(out)]) == 0
    return out


def test_tool_data_on_the_demo_model_is_refused_with_the_answers_it_cannot_write(demo, tmp_path):
    model, _ = demo
    data = gsm8k_file(tmp_path, "--tools")
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", f"trainer.output_dir={tmp_path / 'run'}",
        f"rollout.agent.tools_file={ROOT / 'configs' / 'tools' / 'calculator.yaml'}", "data.max_prompt_length=64",
        "data.filter_overlong_prompts=false", "data.truncation=left"])  # fmt: skip
    errors = {f.field: f.message for f in preflight(cfg) if f.level == "error"}
    tools = errors.pop("rollout.agent.tools_file")
    assert "offers tools, and a call in the format rollout.agent.tool_parser (hermes) reads" in tools
    assert "the model cannot write a tool call" in tools and "megarl data gsm8k without --tools" in tools
    (answer,) = errors.values()
    assert "row 0: a right answer in the format the 'gsm8k' scorer reads, '#### 7', comes back" in answer
    assert "as '7' and scores 0, not 1" in answer and "score with reward.custom" in answer


def test_a_tokenizer_that_writes_them_passes_and_the_demo_task_does_too():
    byte_level = build_tokenizer()
    cfg = load_config(ROOT / "configs" / "gsm8k_tool_agent.yaml", [f"rollout.agent.tools_file={ROOT / 'configs' / 'tools' / 'calculator.yaml'}"])
    found: list[Finding] = []
    check_tool_calls(cfg, lambda: byte_level, found)
    record = type("Record", (), {"row": 0, "data_source": "openai/gsm8k", "ground_truth": "1,234", "extra_info": None})()
    check_answers(cfg, [("data.train_files[0] (g.parquet)", [record])], lambda: byte_level, found)
    assert found == []
    digits = build_tokenizer(TASK_VOCAB)
    assert round_trip(digits, "321") == "321"  # the demo task's answers: writable by the demo model
    reverse = type("Record", (), {"row": 3, "data_source": "reverse_digits", "ground_truth": "321", "extra_info": None})()
    check_answers(cfg, [("f", [reverse])], lambda: digits, found)
    assert found == []


def tool_demo_checks(tmp_path: Path, tokenizer) -> list[Finding]:
    """The pre-launch checks of configs/tiny_tool_agent.yaml on its data, read as the plan reads it."""
    train, _ = write_tool_sums(tmp_path / "data", size=40, val_size=4)
    cfg = load_config(ROOT / "configs" / "tiny_tool_agent.yaml", [f"rollout.agent.tools_file={ROOT / 'configs' / 'tools' / 'calculator.yaml'}"])
    label = file_label("data.train_files[0]", train)
    found: list[Finding] = []
    check_tool_calls(cfg, lambda: tokenizer, found)
    check_answers(cfg, [(label, check_prompt_file(train, label=label))], lambda: tokenizer, found)
    return found


def test_the_tool_demo_passes_on_its_tokenizer_and_is_refused_on_one_without_the_markers_or_plus(tmp_path):
    assert tool_demo_checks(tmp_path / "ok", build_tokenizer(TOOL_SUM_VOCAB, markers=CALL_MARKERS)) == []
    found = {f.field: f.message for f in tool_demo_checks(tmp_path / "digits", build_tokenizer(TASK_VOCAB))}
    call = found.pop("rollout.agent.tools_file")
    assert "(megarl.rollout.agents.compact_calls:calculator_calls) reads, '<tool_call>12+34</tool_call>'" in call
    assert "as '1234': the model cannot write a tool call" in call
    assert "the tool-use demo's model" in call and "Qwen" not in call  # the fix for this format, not a chat model's
    ((where, answer),) = found.items()
    assert where == "data.train_files[0] (train.parquet)" and "\n" not in answer
    assert "a right answer in the format the 'tool_sum' scorer reads, '<tool_call>" in answer
    assert "and scores 0, not 1: the model cannot write it" in answer
