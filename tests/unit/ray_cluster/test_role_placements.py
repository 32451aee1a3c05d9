"""role_placements: the reward model's role gets Ray bundles where the plan puts it, one per
actor: a pool of its own when disaggregated (whole nodes on a multi-node cluster),
the policy's bundles when colocated; below Ray (the specs place_roles creates its groups from)."""

from __future__ import annotations

import json
from pathlib import Path

from megarl.config.loading import load_config
from megarl.plan.planner import make_plan
from megarl.ray_cluster.placement import RolePlacement, _pool_specs, role_placements

PPO7 = Path(__file__).resolve().parents[3] / "configs" / "qwen2.5_7b_ppo.yaml"


def _specs(tmp_path: Path, *overrides: str):
    rm = tmp_path / "rm"
    rm.mkdir(exist_ok=True)
    (rm / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"], "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 512, "torch_dtype": "bfloat16", "num_labels": 1}))  # fmt: skip
    cfg = load_config(PPO7, [f"reward.model.path={rm}", *overrides])
    plan = make_plan(cfg)
    placements, colocate = role_placements(cfg, plan)
    by_role = {p.role: p for p in placements}
    return plan, by_role, {roles: (shape, bundle) for roles, shape, bundle in _pool_specs(by_role, colocate)}


def test_a_disaggregated_reward_model_has_a_bundle_per_planned_device(tmp_path):
    plan, roles, pools = _specs(tmp_path, "reward.model.placement=disaggregated", "reward.model.gpus=4")
    assert plan.reward_model.gpus == (4, 5, 6, 7)
    assert roles["reward_model"] == RolePlacement("reward_model", 1, 4, gpus_per_proc=1.0, cpus_per_proc=1.0)
    assert pools[("reward_model",)][1] == {"CPU": 1.0, "GPU": 1.0}  # its own pool: a whole GPU per actor
    assert ("policy", "critic") in pools  # the training pool is not shared with it
    # whole nodes: one node-group per node it takes
    _, roles, _ = _specs(tmp_path, "reward.model.placement=disaggregated", "reward.model.gpus=16", "cluster.nnodes=4",
                         "cluster.placement=disaggregated", "cluster.rollout_gpus=8")  # fmt: skip
    assert (roles["reward_model"].nnodes, roles["reward_model"].procs_per_node) == (2, 8)


def test_a_colocated_reward_model_shares_the_policy_bundles(tmp_path):
    plan, roles, pools = _specs(tmp_path, "reward.model.placement=colocated")
    assert roles["reward_model"].same_shape(roles["policy"]) and roles["reward_model"].world_size == 8
    shape, bundle = pools[("policy", "critic", "reward_model")]
    assert bundle == {"CPU": 3.0, "GPU": 1.0} and len(pools) == 1  # one GPU per bundle, shared three ways
    assert plan.reward_model.gpus == plan.roles["policy"].gpus
