"""A user's own functions named by import path: the documented examples (docs/examples/) work
through the registries, and wrong paths are refused with the path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.algos import make_kl_controller
from megarl.algos.losses import POLICY_LOSSES, ModelOutputs, make_policy_loss_fn
from megarl.algos.registry import Registry, UnknownNameError
from megarl.algos.step import advantage_step
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.plan.extensions import import_problem, named_functions

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def small_batch() -> Batch:
    lens = torch.tensor([3, 1, 2])
    mask = (torch.arange(3)[None] < lens[:, None]).float()
    return Batch(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                 response_ids=torch.ones(3, 3, dtype=torch.long), response_lengths=lens, response_mask=mask,
                 group_id=torch.tensor([0, 0, 1]), scores=torch.tensor([1.0, 0.0, 0.5]),
                 old_logprobs=torch.full((3, 3), -1.0) * mask)  # fmt: skip


def test_a_custom_estimator_runs_in_the_advantage_step(examples_on_path):
    cfg = AlgorithmConfig(estimator="my_extensions:centered_score")
    batch = small_batch()
    out, _ = advantage_step(batch, cfg, make_kl_controller(cfg.kl), max_new_tokens=3)
    # scores 1, 0, 0.5 -> mean 0.5 -> 0.5, -0.5, 0 on every valid token
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, 0.0])[:, None] * batch.response_mask)


def test_a_custom_policy_loss_is_what_the_update_optimises(examples_on_path):
    cfg = AlgorithmConfig(policy_loss="my_extensions:unclipped_ratio")
    batch = small_batch().replace(advantages=torch.tensor([[2.0, 2.0, 2.0], [-1.0, 0, 0], [1.0, 1.0, 0]]))
    logprobs = torch.full((3, 3), -0.9, requires_grad=True)  # ratio e^0.1 on every token
    loss_sum, count, _ = make_policy_loss_fn(cfg, max_response_length=3)(batch, ModelOutputs(logprobs=logprobs))
    ratio = torch.exp(torch.tensor(0.1))
    expected = -(2.0 * 3 - 1.0 + 1.0 * 2) * ratio  # token-mean: summed here, divided by the count later
    torch.testing.assert_close(loss_sum, expected)
    assert int(count) == 6


def test_wrong_paths_are_refused_with_the_fix(examples_on_path):
    with pytest.raises(UnknownNameError, match="cannot import no_such_module.*PYTHONPATH"):
        POLICY_LOSSES.get("no_such_module:fn")
    with pytest.raises(UnknownNameError, match="has no attribute 'missing'"):
        POLICY_LOSSES.get("my_extensions:missing")
    with pytest.raises(UnknownNameError, match="non-callable 'dataclasses'"):
        Registry("thing").get("my_extensions:dataclasses")  # a module the example imports, not a function
    with pytest.raises(ValueError, match="nor an import path"):
        AlgorithmConfig(estimator="centered_score")


def test_the_config_fields_that_name_functions_and_their_problems(examples_on_path):
    good = MegaRLConfig(model={"arch": "qwen3-8b"}, algorithm={"estimator": "my_extensions:centered_score"},
                        rollout={"generate_function": "my_extensions:generate_with_prefix"})  # fmt: skip
    assert named_functions(good) == [("algorithm.estimator", "my_extensions:centered_score"),
                                     ("rollout.generate_function", "my_extensions:generate_with_prefix")]  # fmt: skip
    assert all(import_problem(field, name) is None for field, name in named_functions(good))
    assert "has no attribute 'nope'" in import_problem("algorithm.policy_loss", "my_extensions:nope")
    assert "cannot import nowhere" in import_problem("rollout.generate_function", "nowhere.at_all:gen")
    assert named_functions(MegaRLConfig(model={"arch": "qwen3-8b"})) == []  # built-in names import nothing
