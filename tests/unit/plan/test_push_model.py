"""The plan's model of a weight push, against hand-computed bytes and times."""

from pathlib import Path

import pytest

from megarl.config.architectures import resolve_arch
from megarl.config.loading import load_config
from megarl.plan.planner import make_plan
from megarl.plan.push_model import GB, push_estimate

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
QWEN72B = CONFIGS / "qwen72b_grpo.yaml"


def test_colocated_72b_sends_each_stage_once_per_tp_group_over_the_network():
    cfg = load_config(QWEN72B)
    arch = resolve_arch(None, "qwen2.5-72b")
    w = 2 * arch.num_params  # bf16
    push = push_estimate(cfg, arch, tp=8, pp=4, dp=1)
    assert push.transport == "tensor"
    assert push.parts == (("TP gather", w / 4 * 7 / 8, "nvlink"),
                          ("PP collect (1/tp slices)", w * 3 / 4 / 8, "network"),
                          ("TP gather of the PP slices", w * 3 / 4 * 7 / 8, "nvlink"))  # fmt: skip
    assert push.seconds == pytest.approx((w / 4 * 7 / 8 + w * 3 / 4 * 7 / 8) / (360 * GB) + w * 3 / 4 / 8 / (45 * GB))
    # ~14 GB per GPU per push over the network: each stage's tensors cross it once per TP group, not once per GPU
    assert 12e9 < sum(b for _, b, link in push.parts if link == "network") < 15e9


def test_the_torch_engine_s_stages_go_to_the_replica_leader_only():
    arch = resolve_arch(None, "qwen2.5-72b")
    w = 2 * arch.num_params
    cfg = load_config(QWEN72B, ["rollout.engine=torch", "cluster.placement=colocated"])
    push = push_estimate(cfg, arch, tp=8, pp=4, dp=1)
    assert push.transport == "in_process"
    assert push.parts == (("TP gather", w / 4 * 7 / 8, "nvlink"), ("PP collect to the leader", w * 3 / 4, "network"))


def test_distributed_sends_each_stage_once_and_disk_goes_through_the_host():
    arch = resolve_arch(None, "qwen2.5-72b")
    w = 2 * arch.num_params
    dist = push_estimate(load_config(QWEN72B, ["rollout.weight_sync.transport=distributed"]), arch, tp=8, pp=4, dp=1)
    assert dist.parts == (("TP gather", w / 4 * 7 / 8, "nvlink"), ("to the engines", w, "network"))
    assert dist.seconds == pytest.approx(w / (45 * GB))  # the send of a bucket hides the next one's TP gather
    disk_keys = ["rollout.weight_sync.transport=disk", "cluster.host_gb_per_s=10"]
    disk = push_estimate(load_config(QWEN72B, disk_keys), arch, tp=8, pp=4, dp=1)
    assert disk.parts[-2:] == (("written by policy rank 0", w, "host"), ("read by each engine GPU", w, "host"))
    assert disk.seconds == pytest.approx(2 * w / (10 * GB))  # writing hides the export; reading waits for the last file
    export = w / 4 * 7 / 8 / (360 * GB) + w * 3 / 4 / (45 * GB)  # TP gather, then the stages to rank 0
    in_turn = push_estimate(load_config(QWEN72B, [*disk_keys, "rollout.weight_sync.overlap=false"]), arch, tp=8, pp=4, dp=1)
    assert in_turn.seconds == pytest.approx(export + 2 * w / (10 * GB))


def test_a_policy_within_one_node_collects_its_stages_over_nvlink():
    arch = resolve_arch(None, "qwen2.5-72b")
    push = push_estimate(load_config(QWEN72B, ["cluster.nnodes=1"]), arch, tp=4, pp=2, dp=1)
    assert [link for _, _, link in push.parts] == ["nvlink", "nvlink", "nvlink"]


def test_the_plan_carries_it_and_the_cpu_demo_moves_nothing_over_a_link():
    plan = make_plan(load_config(CONFIGS / "tiny_grpo.yaml"))
    assert plan.push is not None and plan.push.transport == "in_process" and plan.push.parts == ()


def test_a_deadline_below_the_estimate_is_a_warning_naming_the_key():
    slow = ["cluster.network_gb_per_s=5"]  # the 72B push then takes about 3 s
    plan = make_plan(load_config(QWEN72B, [*slow, "rollout.weight_sync.timeout_s=1"]))
    (warning,) = [w for w in plan.warnings if w.field == "rollout.weight_sync.timeout_s"]
    assert "(1) is shorter than the plan's estimate of one push (3.1 s, a lower bound)" in warning.message
    assert not [w for w in make_plan(load_config(QWEN72B, slow)).warnings if w.field == "rollout.weight_sync.timeout_s"]


def test_experts_are_gathered_over_ep_before_the_push():
    """An MoE policy's experts are not TP shards: the TP gather moves the rest, an EP gather the
    other expert-parallel ranks' experts, on NVLink while the EP group fits in a node."""
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_grpo.yaml")
    arch = resolve_arch(None, "qwen3-30b-a3b")
    w, x = 2 * arch.num_params, 2 * 48 * 128 * 3 * 2048 * 768  # bf16: all, the experts
    push = push_estimate(cfg, arch, tp=2, pp=1, dp=16, ep=8)
    assert push.parts == (("TP gather", (w - x) / 2, "nvlink"), ("EP gather", x * 7 / 8, "nvlink"))
    assert push.seconds == pytest.approx(((w - x) / 2 + x * 7 / 8) / (360 * GB))
    wide = push_estimate(cfg, arch, tp=2, pp=1, dp=16, ep=16)  # 16 ranks: two nodes
    assert wide.parts[1] == ("EP gather", x * 15 / 16, "network")
