import pytest
import torch

from megarl.algos import make_kl_controller
from megarl.algos.step import advantage_step
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.data.batch import Batch


def batch_of(lengths: list[int], scores: list[float], groups: list[int], r: int = 10) -> Batch:
    b = len(lengths)
    lens = torch.tensor(lengths)
    g = torch.Generator().manual_seed(0)
    return Batch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.ones(b, r, dtype=torch.long),
        response_lengths=lens,
        response_mask=(torch.arange(r)[None] < lens[:, None]).float(),
        group_id=torch.tensor(groups),
        scores=torch.tensor(scores),
        old_logprobs=-torch.rand(b, r, generator=g),
        ref_logprobs=-torch.rand(b, r, generator=g),
    )


def test_overlong_shaping_kl_penalty_and_controller_update():
    batch = batch_of([10, 4, 8, 2], [1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1])
    cfg = AlgorithmConfig(
        estimator="dr_grpo",
        overlong={"length": 4, "penalty": 1.0},
        kl={
            "use_in_reward": True,
            "estimator": "k1",
            "coef": 0.1,
            "controller": "adaptive",
            "target": 1e-3,
            "horizon": 100,
        },
    )
    ctl = make_kl_controller(cfg.kl)
    out, metrics = advantage_step(batch, cfg, ctl, max_new_tokens=10)
    mask = batch.response_mask
    kl = (batch.old_logprobs - batch.ref_logprobs) * mask
    shaped = torch.tensor([0.0, 1.0, -0.5, 0.0])  # length 10 -> -1, length 8 -> -0.5
    expected = -0.1 * kl
    expected[torch.arange(4), batch.response_lengths - 1] += shaped
    torch.testing.assert_close(out.token_rewards, expected)
    sums = expected.sum(-1)
    centred = torch.stack(
        [
            sums[0] - sums[:2].mean(),
            sums[1] - sums[:2].mean(),
            sums[2] - sums[2:].mean(),
            sums[3] - sums[2:].mean(),
        ]
    )
    torch.testing.assert_close(out.advantages, centred[:, None] * mask)
    # The step emits public names (megarl/metrics.py); the reward statistics are rollout_metrics'.
    assert set(metrics) == {
        "reward/kl", "reward/kl_coef", "reward/overlong_penalty_mean", "advantages/mean", "advantages/return_mean",
    }
    assert metrics["reward/kl_coef"] == 0.1 and ctl.value > 0.1  # KL far above target: coefficient grew
    lengths = torch.tensor([10.0, 4.0, 8.0, 2.0])
    assert metrics["reward/kl"] == pytest.approx(float((kl.sum(-1) / lengths).mean()), rel=1e-6)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-1.5 / 4)
    # token mean: each row's advantage counts once per valid token (10 + 4 + 8 + 2 tokens)
    assert metrics["advantages/mean"] == pytest.approx(float((centred * lengths).sum() / 24), abs=1e-6)


def test_needs_scores():
    batch = batch_of([3], [1.0], [0]).replace(scores=None)
    with pytest.raises(ValueError, match="scores"):
        advantage_step(batch, AlgorithmConfig(), make_kl_controller(AlgorithmConfig().kl), 10)
