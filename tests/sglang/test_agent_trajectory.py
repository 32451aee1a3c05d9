"""A multi-turn trajectory through the real SGLang server: each turn continues from the
trajectory's token ids, and transformers, scoring the final ids as the trainer would, gives the
log-probs the server reported for every generated token (none for the context between turns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from agent_doubles import FirstCallHangs, always_call, chat_prompts

from megarl.config.rollout_sections import AgentConfig
from megarl.engines.base import SamplingParams
from megarl.rollout.agents.driver import AgentRollout, build_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
ATOL = 1e-4  # fp32, two implementations of the same arithmetic


def test_a_two_turn_trajectory_is_id_exact_against_transformers(engine, hf, tiny_model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(str(EXAMPLES))
    users = tmp_path / "users.yaml"
    users.write_text(yaml.safe_dump({"interaction": [{"name": "echo", "class_name": "agent_extensions.EchoUser"}]}))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = AgentConfig(interactions_file=str(users), default_agent="tool_agent", max_tokens_per_turn=6)
    env = build_env(cfg, tok, [tok.convert_tokens_to_ids("<|im_end|>")])
    texts = ["Hello", "The cat"]
    prompts = chat_prompts(tok, texts, extra_info=[{"interaction_kwargs": {"name": "echo"}} for _ in texts])
    ids = prompts.prompt_ids
    batch = AgentRollout(cfg, env, overlap_tools=True)(engine, prompts, SamplingParams(max_new_tokens=40, n=2, seed=7))
    assert len(batch) == 4
    for row in range(4):
        n = int(batch.response_lengths[row])
        response = batch.response_ids[row, :n].tolist()
        mask = batch.response_mask[row, :n]
        prompt = ids[row // 2]
        assert batch.extra_info[row]["agent"]["turns"] == 2 and 0 < mask.sum() < n  # the user's turn is context
        assert "<|im_start|>user\n1<|im_end|>" in tok.decode(response)  # the interaction's answer, between turns
        ref, _ = hf.logprobs(prompt, response)
        got = batch.rollout_logprobs[row, :n].double()
        assert got[mask > 0] == pytest.approx(ref[mask > 0], abs=ATOL)
        assert torch.all(got[mask == 0] == 0)


def test_a_hanging_tool_holds_up_only_its_own_trajectory(engine, tiny_model):
    """8 trajectories; the rollout's first tool call hangs. With SGLang's default (overlap) the
    other 7 run their next turn and call again while it waits for its 2 s deadline."""
    from transformers import AutoTokenizer

    from megarl.rollout.agents.chat import TurnEncoder
    from megarl.rollout.agents.loops import AgentEnv

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = AgentConfig(default_agent="tool_agent", max_turns=3, tool_timeout_s=2.0, max_tokens_per_turn=4)
    tool = FirstCallHangs({}, {"type": "function", "function": {"name": "wait"}})
    env = AgentEnv({"wait": tool}, always_call("wait"), TurnEncoder(tok, [tok.convert_tokens_to_ids("<|im_end|>")]), cfg)
    prompts = chat_prompts(tok, ["Hi"] * 8)
    batch = AgentRollout(cfg, env, overlap_tools=True)(engine, prompts, SamplingParams(max_new_tokens=200, seed=3))
    starts = sorted(tool.starts)
    assert len(starts) == 16 and batch.finish_reason == ["max_turns"] * 8  # two calls per trajectory
    assert all(t < starts[0] + 2.0 for t in starts[:15])  # 7 second calls went while the first one hung
    assert starts[15] >= starts[0] + 2.0  # the hung trajectory's second call came after its deadline
