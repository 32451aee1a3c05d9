"""The plan's routing replay bytes for the shipped Qwen3-235B-A22B config, against a hand computation."""

from pathlib import Path

import torch
from rich.console import Console

from megarl.config.architectures import resolve_arch
from megarl.config.loading import load_config
from megarl.data.routing_ids import expert_id_dtype
from megarl.plan.gpu_memory import GIB
from megarl.plan.planner import make_plan
from megarl.plan.report import print_plan
from megarl.plan.routing_bytes import routing_bytes

MOE235 = Path(__file__).parents[3] / "configs" / "qwen3_235b_a22b_grpo.yaml"
# configs/qwen3_235b_a22b_grpo.yaml: 256 prompts x n 8, 1024 + 3072 tokens; the model: 94 layers,
# all MoE, 128 experts (ids in a byte), top-8
STEP = 256 * 8 * (1024 + 3072) * 94 * 8  # 6,308,233,216 bytes of uint8 ids


def test_235b_routing_bytes_match_a_hand_computation():
    cfg = load_config(MOE235, [])
    r = routing_bytes(cfg, resolve_arch(cfg.model.path, cfg.model.arch), 16)  # 128 GPUs / (tp 4 x pp 2)
    assert r is not None and r.shape == (2048, 4096, 94, 8) and r.id_bytes == 1 and r.weight_bytes == 0
    # ppo_epochs 1: a rank's update share is its replica's rows of the whole batch (the replay
    # metrics' forwards) and of the mini-batches, 2 x 2048 / 16 rows; the controller keeps its
    # Batch and the object store the 16 shares
    assert r.step == STEP and r.per_policy_rank == STEP * 2 / 16 and r.controller == STEP + 2 * STEP
    assert r.sglang_base64 == 2048 * 4095 * 94 * 8 * 4 * 4 / 3  # int32 over every layer, the last token left out
    assert expert_id_dtype(128) == torch.uint8 and expert_id_dtype(256) == torch.int16  # the planner's rule is the Batch's


def test_235b_host_memory_counts_routing_on_the_head_node():
    cfg = load_config(MOE235, [])
    host = make_plan(cfg).memory.host
    # node 0 holds the controller's Batch and shares, and its 8 policy ranks' shares
    assert make_plan(cfg).roles["policy"].dp == 16
    assert host.node == 0 and host.routing == 3 * STEP + 8 * STEP * 2 / 16
    console = Console(record=True, width=400)
    print_plan(cfg, make_plan(cfg), console)
    text = console.export_text()
    assert "routing replay ids uint8 [2048 x 4096 x 94 x 8] 6.3 GB a step" in text
    assert "each policy rank at most 0.8 GB" in text
    assert f"routing replay {4 * STEP / GIB:.1f}" in text  # in the host memory line (23.5 GiB)


def test_replayed_weights_add_the_engine_dtype_and_dense_models_have_none():
    cfg = load_config(MOE235, ["rollout.engine=torch", "actor.moe.routing_replay=experts_and_weights"])
    r = routing_bytes(cfg, resolve_arch(cfg.model.path, cfg.model.arch), 16)
    assert r is not None and r.weight_bytes == 2 and r.step == 3 * STEP and r.sglang_base64 == 0  # bf16 weights
    off = load_config(MOE235, ["actor.moe.routing_replay=none"])
    assert routing_bytes(off, resolve_arch(off.model.path, off.model.arch), 16) is None
