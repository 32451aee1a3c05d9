"""The generate functions a config names (megarl/rollout/generate.py): ``default`` is the agent
rollout bound to the run, a user's function by import path is used as it is, and one that asks
for the run's settings (``for_run``) gets them, whatever its name."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import SamplingParams
from megarl.rollout.agents.driver import AgentRollout
from megarl.rollout.agents.errors import AgentError
from megarl.rollout.generate import GENERATE_FUNCTIONS, make_generate
from megarl.rollout.single_turn import generate_batch

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def prompts(ids: list[list[int]], agent_name: list[str] | None = None) -> PromptBatch:
    k = len(ids)
    return PromptBatch(prompt_ids=ids, data_source=["t"] * k, ground_truth=[""] * k, extra_info=[{}] * k,
                       prompt_text=[""] * k, index=list(range(k)), file_index=[0] * k, agent_name=agent_name or [])  # fmt: skip


def test_default_is_the_agent_rollout_bound_to_the_run():
    cfg = load_config(TINY, ["rollout.agent.default_agent=tool_agent"])
    fn = make_generate(cfg, tokenizer=object(), eos_token_ids=[0])  # no chat template: no agent env
    assert isinstance(fn, AgentRollout) and fn.cfg is cfg.rollout.agent and fn.env is None
    assert "default" in GENERATE_FUNCTIONS


def test_a_users_function_is_used_as_is_and_one_asking_for_the_run_is_bound(tmp_path, monkeypatch):
    (tmp_path / "my_generate.py").write_text(textwrap.dedent("""
        import torch
        from megarl.data.batch import Batch

        def batch(*tags):  # a generate function returns a Batch: one response, its group id the tags
            one = torch.ones(1, 1, dtype=torch.long)
            return Batch(one, one, one, torch.ones(1, dtype=torch.long), one.float(), torch.tensor([sum(tags)]),
                         data_source=[repr(tags)])

        def plain(engines, prompts, params):
            return batch(1)

        class Bound:
            def __call__(self, engines, prompts, params):
                return batch(2)

            def for_run(self, cfg, tokenizer, eos_token_ids):
                return lambda engines, prompts, params: batch(cfg.trainer.seed, *eos_token_ids)

        bound = Bound()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        plain = make_generate(load_config(TINY, ["rollout.generate_function=my_generate:plain"]), None, [7])
        assert plain(None, None, None).data_source == ["(1,)"]
        bound = make_generate(load_config(TINY, ["rollout.generate_function=my_generate:bound", "trainer.seed=3"]), None, [7])
        assert bound(None, None, None).data_source == ["(3, 7)"]
    finally:
        sys.modules.pop("my_generate", None)


def test_default_called_unbound_generates_single_turn_and_refuses_agent_loops(task_engine):
    default = GENERATE_FUNCTIONS.get("default")
    params = SamplingParams(max_new_tokens=3, n=2, seed=1)
    batch = default(task_engine, prompts([[1, 2, 3], [4, 5]]), params)
    reference = generate_batch(task_engine, prompts([[1, 2, 3], [4, 5]]), params)
    assert batch.response_ids.tolist() == reference.response_ids.tolist()
    with pytest.raises(AgentError, match="called without its run's settings, and agent loop 'tool_agent'"):
        default(task_engine, prompts([[1, 2, 3]], agent_name=["tool_agent"]), params)
