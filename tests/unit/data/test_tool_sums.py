"""The tool-use demo's data: a disjoint split of sums, and correct trajectories that the demo
tokenizer writes, the compact parser reads as the calculator call and the scorer scores 1.0."""

from __future__ import annotations

from megarl.data.tool_sums import (
    CALL_MARKERS,
    TOOL_SUM,
    TOOL_SUM_VOCAB,
    correct_trajectory,
    tool_sum_rows,
)
from megarl.models.tiny import build_tokenizer
from megarl.rewards import compute_score
from megarl.rollout.agents.compact_calls import calculator_calls
from megarl.rollout.agents.tool_calls import ToolCall


def test_split_is_disjoint_and_the_truth_is_the_sum():
    train, val = tool_sum_rows(size=500, val_size=100, seed=3)
    prompts = [r["prompt"][0]["content"] for r in train + val]
    assert len(train) == 400 and len(val) == 100 and len(set(prompts)) == 500
    for r in train + val:
        a, b = (int(x) for x in r["prompt"][0]["content"].split("+"))
        assert 10 <= a <= 999 and 10 <= b <= 999 and r["reward_model"]["ground_truth"] == str(a + b)
        assert r["data_source"] == TOOL_SUM and r["agent_name"] == "tool_agent"
    assert tool_sum_rows(size=500, val_size=100, seed=3) == (train, val)


def test_a_correct_trajectory_is_written_in_the_demo_vocabulary_and_scores_one():
    tok = build_tokenizer(TOOL_SUM_VOCAB, markers=CALL_MARKERS)
    row = tool_sum_rows(size=20, val_size=5)[0][0]
    messages = correct_trajectory(row)
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(messages, tokenize=False)
    ids = tok(whole)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids, skip_special_tokens=False) == whole
    response = whole[len(prompt):].removesuffix("<|im_end|>")  # as the reward sees it: the final EOS dropped
    expression = row["prompt"][0]["content"]
    assert calculator_calls(response.split("<|im_end|>")[0]).items == [ToolCall("calculator", {"expression": expression})]
    assert compute_score(TOOL_SUM, response, row["reward_model"]["ground_truth"], row["extra_info"]) == 1.0


def test_the_parser_answers_malformed_calls_with_an_error():
    parsed = calculator_calls("<tool_call></tool_call><tool_call>1+2</tool_call><tool_call>3")
    assert parsed.calls == [ToolCall("calculator", {"expression": "1+2"})]
    assert parsed.errors[0].startswith("Error: write the sum between the markers") and "not closed" in parsed.errors[1]
