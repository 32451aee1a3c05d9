"""The LR schedule: warm-up, then constant / linear / cosine decay to min_lr (hand-computed)."""

import math

import pytest
import torch

from megarl.config.train_sections import OptimizerConfig
from megarl.megatron_runtime.optim import LRSchedule


def test_warmup_then_cosine_and_linear():
    cos = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="cosine"), total_steps=6)
    assert [round(cos.lr_at(k), 6) for k in range(2)] == [0.5, 1.0]
    assert cos.lr_at(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.lr_at(6) == pytest.approx(0.1) and cos.lr_at(100) == pytest.approx(0.1)
    lin = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.0, schedule="linear"), total_steps=4)
    assert [lin.lr_at(k) for k in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_apply_honours_group_multipliers_and_state_round_trips():
    sched = LRSchedule(OptimizerConfig(lr=2.0, warmup_steps=4, weight_decay=0.1))
    opt = torch.optim.AdamW([{"params": [torch.zeros(1, requires_grad=True)], "wd_mult": 0.0, "lr_mult": 0.5}])
    sched.advance()
    assert sched.apply(opt) == 1.0
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.0
    other = LRSchedule(OptimizerConfig(lr=2.0, warmup_steps=4))
    other.load_state_dict(sched.state_dict())
    assert other.current_lr == 1.0


def test_apply_sets_the_configs_adam_settings_over_loaded_ones():
    # a checkpoint's optimizer state_dict brings the param groups it was saved with
    opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], betas=(0.9, 0.999), eps=1e-8)
    LRSchedule(OptimizerConfig(lr=1.0, betas=(0.5, 0.6), eps=1e-3)).apply(opt)
    assert opt.param_groups[0]["betas"] == (0.5, 0.6) and opt.param_groups[0]["eps"] == 1e-3


def test_decay_without_horizon_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="total_optimizer_steps"):
        LRSchedule(OptimizerConfig(schedule="cosine"))
