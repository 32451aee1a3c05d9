"""The rollout phase's strategies against a real torch engine and reward pool: ReMax's greedy baseline."""

from __future__ import annotations

import pytest
import torch

from megarl.algos.dapo import overlong_penalty
from megarl.config.algorithm_sections import OverlongConfig
from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.data.batch import Batch
from megarl.engines.base import SamplingParams
from megarl.rollout.collect import GreedyBaseline, Scorer

PROMPTS = [[3, 4, 5, 6, 7], [8, 9]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def scorer(task_engine, tmp_path_factory):
    from megarl.rewards.scorer import RewardScorer

    path = tmp_path_factory.mktemp("reward") / "one.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with RewardScorer(RewardConfig(custom=CustomRewardConfig(path=str(path)), workers=1)) as rewards:
        yield Scorer(rewards, task_engine.tokenizer, task_engine.eos_token_ids)


def _two_groups() -> Batch:
    """Two prompts with two samples each (only the prompts matter to the baseline)."""
    rows = [0, 0, 1, 1]
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(PROMPTS[r])) + PROMPTS[r] for r in rows])
    mask = torch.tensor([[0] * (width - len(PROMPTS[r])) + [1] * len(PROMPTS[r]) for r in rows])
    return Batch(prompt_ids=ids, prompt_mask=mask, response_ids=torch.zeros(4, 1, dtype=torch.long),
                 response_lengths=torch.ones(4, dtype=torch.long), response_mask=torch.ones(4, 1),
                 group_id=torch.tensor(rows), data_source=["t"] * 4, ground_truth=["x"] * 4,
                 extra_info=[{} for _ in rows], prompt_text=["p"] * 4, finish_reason=["stop"] * 4)  # fmt: skip


def test_remax_baseline_is_shaped_by_overlong_like_the_samples(task_engine, scorer):
    # The samples' scores get DAPO's overlong penalty before the advantages; the greedy
    # baseline's did not, so a long greedy response raised the baseline by the penalty it
    # should have carried and lowered every advantage of its group.
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
    lengths = torch.tensor([len(r.response_ids) for r in task_engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))])  # fmt: skip
    overlong = OverlongConfig(length=MAX_NEW - 1, penalty=0.5)
    penalty = overlong_penalty(lengths, MAX_NEW, overlong.length, overlong.penalty)  # [2]
    assert (penalty < 0).all()  # every greedy response reaches into the window: the test shapes something
    plain = GreedyBaseline(task_engine, scorer).scores(_two_groups(), params)
    assert plain.tolist() == [1.0, 1.0, 1.0, 1.0]
    shaped = GreedyBaseline(task_engine, scorer, overlong, MAX_NEW).scores(_two_groups(), params)
    assert shaped.tolist() == pytest.approx((1.0 + penalty.repeat_interleave(2)).tolist())
    off = GreedyBaseline(task_engine, scorer, OverlongConfig(length=0), MAX_NEW).scores(_two_groups(), params)
    assert off.tolist() == [1.0, 1.0, 1.0, 1.0]
