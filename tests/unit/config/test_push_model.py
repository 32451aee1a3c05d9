"""The plan's model of a weight push, against hand-computed bytes and times."""

import pytest

from megarl.config.architectures import resolve_arch
from megarl.config.loading import load_config
from megarl.config.planner import make_plan
from megarl.config.push_model import GB, push_estimate

QWEN72B = "configs/qwen72b_grpo.yaml"


def test_colocated_72b_pays_the_tp_gather_on_nvlink_and_the_pp_collect_on_the_network():
    cfg = load_config(QWEN72B)
    arch = resolve_arch(None, "qwen2.5-72b")
    w = 2 * arch.num_params  # bf16
    push = push_estimate(cfg, arch, tp=8, pp=4, dp=1)
    assert push.transport == "tensor"
    assert push.parts == (("TP gather", w / 4 * 7 / 8, "nvlink"), ("PP collect", w * 3 / 4, "network"))
    assert push.seconds == pytest.approx(w / 4 * 7 / 8 / (360 * GB) + w * 3 / 4 / (45 * GB))
    assert 100e9 < sum(b for _, b, link in push.parts if link == "network") < 120e9  # ~100 GB per GPU per push


def test_distributed_sends_each_stage_once_and_disk_goes_through_the_host():
    arch = resolve_arch(None, "qwen2.5-72b")
    w = 2 * arch.num_params
    dist = push_estimate(load_config(QWEN72B, ["rollout.weight_sync.transport=distributed"]), arch, tp=8, pp=4, dp=1)
    assert dist.parts == (("TP gather", w / 4 * 7 / 8, "nvlink"), ("to the engines", w, "network"))
    disk = push_estimate(load_config(QWEN72B, ["rollout.weight_sync.transport=disk", "cluster.host_gb_per_s=10"]),
                         arch, tp=8, pp=4, dp=1)  # fmt: skip
    assert disk.parts[-2:] == (("written by policy rank 0", w, "host"), ("read by each engine GPU", w, "host"))
    assert disk.seconds > 2 * w / (10 * GB)


def test_a_policy_within_one_node_collects_its_stages_over_nvlink():
    arch = resolve_arch(None, "qwen2.5-72b")
    push = push_estimate(load_config(QWEN72B, ["cluster.nnodes=1"]), arch, tp=4, pp=2, dp=1)
    assert [link for _, _, link in push.parts] == ["nvlink", "nvlink"]


def test_the_plan_carries_it_and_the_cpu_demo_moves_nothing_over_a_link():
    plan = make_plan(load_config("configs/tiny_grpo.yaml"))
    assert plan.push is not None and plan.push.transport == "in_process" and plan.push.parts == ()


def test_a_deadline_below_the_estimate_is_a_warning_naming_the_key():
    plan = make_plan(load_config(QWEN72B, ["rollout.weight_sync.timeout_s=1"]))
    (warning,) = [w for w in plan.warnings if w.field == "rollout.weight_sync.timeout_s"]
    assert "(1) is shorter than the plan's estimate of one push (2.5 s, a lower bound)" in warning.message
    assert not [w for w in make_plan(load_config(QWEN72B)).warnings if w.field == "rollout.weight_sync.timeout_s"]
