"""CriticWorker at TP=2 (replicated value head) on a tiny Qwen2: alignment, masks, learning.

One 2-process spawn: values are [B, R], 0 past each response, identical on both ranks and
independent of how much left padding a prompt carries (the value of token t is read at the
position that predicts it); the clipped value loss of megarl.algos falls over a few PPO-style
rounds towards fixed returns.
"""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import CriticConfig, OptimizerConfig, ParallelConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("critic") / "m", **ac.TINY))


def _wider_prompts(batch, extra: int):
    """The same rows with ``extra`` more columns of left padding."""
    pad = torch.zeros(len(batch), extra, dtype=torch.long)
    return batch.replace(prompt_ids=torch.cat([pad, batch.prompt_ids], 1), prompt_mask=torch.cat([pad, batch.prompt_mask], 1))


def _critic_run(rank: int, world: int, path: str) -> dict:
    from megarl.actors.critic import CriticWorker
    from megarl.algos.losses import make_value_loss_fn
    from megarl.config.algorithm_sections import AlgorithmConfig

    cfg = CriticConfig(
        parallel=ParallelConfig(tp=2), micro_batch_size=2, optimizer=OptimizerConfig(lr=3e-3, clip_grad=1.0)
    )
    critic = CriticWorker(path, cfg, "float32", seed=3)
    batch = ac.make_batch(1)
    returns = torch.linspace(-1.0, 1.0, batch.response_len).expand(len(batch), -1) * batch.response_mask
    batch = batch.replace(returns=returns.contiguous())
    wide = _wider_prompts(batch, 3)
    out = {"values": ac.gathered(critic.compute_values(batch), batch)["values"],
           "values_wide": ac.gathered(critic.compute_values(wide), wide)["values"]}  # fmt: skip
    loss_fn = make_value_loss_fn(AlgorithmConfig())
    losses = []
    for _ in range(4):
        batch = batch.replace(values=ac.gathered(critic.compute_values(batch), batch)["values"])
        losses.append(critic.update(batch, loss_fn, mini_batch_size=3)["critic/vf_loss"])
    out["losses"] = losses
    return ac.portable(out)


def test_critic_values_and_value_loss_falls(model_dir):
    results = [ac.tensors(r) for r in run_distributed(_critic_run, 2, model_dir)]
    batch = ac.make_batch(1)
    values = results[0]["values"]
    assert values.shape == batch.response_ids.shape
    assert (values[batch.response_valid == 0] == 0).all()
    assert values[batch.response_valid == 1].abs().sum() > 0
    torch.testing.assert_close(results[0]["values_wide"], values, atol=1e-5, rtol=0)
    assert torch.equal(results[1]["values"], values)
    losses = results[0]["losses"]
    assert results[1]["losses"] == losses
    assert losses[-1] < 0.7 * losses[0], losses
