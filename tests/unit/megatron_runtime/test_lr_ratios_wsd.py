"""LR warm-up and final LR as ratios (verl's lr_warmup_steps_ratio, min_lr_ratio) and the
warmup-stable-decay schedule (verl's get_wsd_schedule_with_warmup), by hand."""

import math

import pytest

from megarl.config.loading import ConfigError, load_config
from megarl.config.train_sections import OptimizerConfig
from megarl.megatron_runtime.optim import LRSchedule


def test_warmup_ratio_and_min_lr_ratio_resolve_against_the_run():
    cfg = OptimizerConfig(lr=2.0, warmup_ratio=0.25, min_lr_ratio=0.1, schedule="linear")
    sched = LRSchedule(cfg, total_steps=10)  # warm-up int(0.25 x 10) = 2 steps, final lr 0.2
    assert sched.warmup_steps == 2 and sched.min_lr == pytest.approx(0.2)
    assert [sched.lr_at(k) for k in range(2)] == [1.0, 2.0]
    assert sched.lr_at(6) == pytest.approx(0.2 + 1.8 * (1 - 4 / 8))
    assert sched.lr_at(10) == pytest.approx(0.2)
    constant = LRSchedule(OptimizerConfig(lr=1.0, warmup_ratio=0.3), total_steps=7)  # int(2.1) = 2
    assert [constant.lr_at(k) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="warmup_ratio=0.3 needs the run's optimizer steps"):
        LRSchedule(OptimizerConfig(warmup_ratio=0.3))


@pytest.mark.parametrize("keys", [("warmup_ratio=0.1", "warmup_steps=5"), ("min_lr_ratio=0.1", "min_lr=1e-7")])
def test_a_ratio_beside_its_absolute_key_is_one_line_naming_both(keys):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=/m", *(f"actor.optimizer.{k}" for k in keys)])
    line = str(err.value).splitlines()[-1]
    ratio, absolute = (k.split("=")[0] for k in keys)
    assert f"{ratio} (" in line and f"{absolute} (" in line and f"keep one: {absolute}=0 or {ratio}=null" in line
    assert OptimizerConfig(warmup_ratio=0.1, warmup_steps=0, min_lr_ratio=0.1, min_lr=0.0)  # the defaults are no setting


def test_wsd_warms_up_holds_then_decays_over_the_last_fraction():
    # 20 steps, 2 of warm-up; of the 18 left int(18 x 0.75) = 13 stay at lr, 5 decay (cosine) to 0.1 x lr
    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule="wsd", wsd_decay_ratio=0.25)
    sched = LRSchedule(cfg, total_steps=20)
    assert [sched.lr_at(k) for k in range(2)] == [0.5, 1.0]
    assert all(sched.lr_at(k) == 1.0 for k in range(2, 15))
    for k in range(15, 20):
        assert sched.lr_at(k) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 15) / 5))), k
    assert sched.lr_at(20) == pytest.approx(0.1) and sched.lr_at(50) == pytest.approx(0.1)


def test_wsd_matches_verls_shape_after_the_warmup():
    """verl's get_wsd_schedule_with_warmup (stable_ratio 0.9 = 1 - wsd_decay_ratio's default)."""
    total, warmup, min_ratio = 37, 3, 0.05

    def verl(step: int) -> float:
        remaining = max(0, total - warmup)
        stable = int(remaining * 0.9)
        decay = remaining - stable
        if step < warmup + stable:
            return 1.0
        if step < total:
            progress = (step - warmup - stable) / max(1, decay)
            return (1 - min_ratio) * max(0.0, 0.5 * (1 + math.cos(math.pi * 0.5 * 2 * progress))) + min_ratio
        return min_ratio

    sched = LRSchedule(OptimizerConfig(lr=3.0, warmup_steps=warmup, min_lr_ratio=min_ratio, schedule="wsd"), total)
    for k in range(warmup, total + 3):
        assert sched.lr_at(k) == pytest.approx(3.0 * verl(k)), k


def test_resume_continues_the_schedule_exactly():
    cfg = OptimizerConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.2, schedule="wsd", wsd_decay_ratio=0.5)
    run = LRSchedule(cfg, total_steps=30)
    lrs = []
    for _ in range(30):
        lrs.append(run.current_lr)
        run.advance()
    resumed = LRSchedule(cfg, total_steps=30)
    half = LRSchedule(cfg, total_steps=30)
    for _ in range(17):
        half.advance()
    resumed.load_state_dict(half.state_dict())
    tail = []
    for _ in range(13):
        tail.append(resumed.current_lr)
        resumed.advance()
    assert tail == lrs[17:]
