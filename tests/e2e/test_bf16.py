"""bf16 runs end to end on the CPU: GRPO with the policy at TP=2, PPO with a critic at PP=2.

Each run is the real stack (Ray, Megatron over gloo, the torch engine fed by weight sync) for
two steps. After every push the engine and the trainer score the same probe responses and the
run stops if they differ by more than rollout.weight_sync.max_logprob_diff: a run that finishes
has passed that check at every step, in bf16. PP=2 exercises the export path that broke bf16
(each stage broadcasting its tensors to the other); the critic is built, trained and
checkpointed in bf16 too.
"""

from __future__ import annotations

import math

import pytest
from run_helpers import train

pytestmark = pytest.mark.slow
BF16 = "model.dtype=bfloat16"


def _check_sync(records: list[dict], max_diff: float) -> None:
    for record in records:
        diff, worst = record["weight_sync/logprob_diff"], record["weight_sync/logprob_diff_max"]
        assert math.isfinite(diff) and 0 <= diff <= max_diff and diff <= worst, record
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0, record
    print("bf16 weight_sync/logprob_diff mean, max per step:",
          [(round(r["weight_sync/logprob_diff"], 5), round(r["weight_sync/logprob_diff_max"], 5)) for r in records])


def test_grpo_bf16_tp2(ray_local, demo_root, tmp_path):
    cfg, _, records = train(demo_root, tmp_path / "grpo", 2, BF16, "actor.parallel.tp=2")
    assert cfg.model.dtype == "bfloat16" and cfg.actor.parallel.tp == 2
    assert [r["step"] for r in records] == [1, 2]
    _check_sync(records, cfg.rollout.weight_sync.max_logprob_diff)


def test_ppo_bf16_pp2_with_critic(ray_local, demo_root, tmp_path):
    cfg, _, records = train(
        demo_root, tmp_path / "ppo", 2, BF16, "actor.parallel.pp=2", "critic.parallel.pp=2",
        "algorithm.estimator=gae", "algorithm.lam=0.95", "critic.mini_batch_size=32",
        "critic.micro_batch_size=16", "critic.optimizer.lr=1e-3", "trainer.save_freq=2",
    )
    assert cfg.actor.parallel.pp == 2 and cfg.critic.parallel.pp == 2
    assert [r["step"] for r in records] == [1, 2]
    _check_sync(records, cfg.rollout.weight_sync.max_logprob_diff)
    for record in records:
        assert math.isfinite(record["critic/loss"])
    ckpt = tmp_path / "ppo" / "checkpoints" / "step_000002"
    assert (ckpt / "manifest.json").is_file()  # policy and critic saved in bf16 at PP=2
