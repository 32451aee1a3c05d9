"""The planner under LoRA (actor.lora): adapter parameters against hand-computed counts, the
policy's memory, the push, the checks and the report line (megarl/plan/lora_checks.py)."""

import dataclasses
import re
from pathlib import Path

import pytest
from rich.console import Console

from megarl.config.architectures import builtin_arch
from megarl.config.loading import load_config
from megarl.plan.gpu_memory import (
    GIB,
    lora_expert_params_per_gpu,
    lora_layer_params,
    lora_params,
    lora_params_per_gpu,
    train_memory,
)
from megarl.plan.host_memory import save_gather_host_bytes
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.push_model import push_estimate
from megarl.plan.report import print_plan
from megarl.plan.role_layout import RoleLayout

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LORA72 = CONFIGS / "qwen72b_grpo_lora.yaml"
GRPO72 = CONFIGS / "qwen72b_grpo.yaml"
TINY = CONFIGS / "tiny_grpo.yaml"
MOE30 = CONFIGS / "qwen3_30b_a3b_grpo.yaml"
DSV3 = CONFIGS / "deepseek_v3_grpo.yaml"
TINY_DSV3 = CONFIGS / "tiny_dsv3_grpo.yaml"
TINY_MOE = CONFIGS / "tiny_moe_grpo.yaml"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ALL[:4]

# tiny-demo: hidden 64, 4 heads x 16, 2 kv heads (k, v out 32), ffn 128, 2 layers; rank 4.
# A is [4 x in], B [out x 4]. Column-parallel (A replicated, B split over tp):
#   q 4*64 + 64*4 = 256 + 256, k and v 256 + 32*4 = 256 + 128 each, gate and up 256 + 128*4 = 256 + 512 each;
# row-parallel (A split, B replicated): o 4*64 + 64*4 = 256 + 256, down 4*128 + 64*4 = 512 + 256.
REPLICATED = 256 * 5 + 256 + 256  # the column-parallel A's, the row-parallel B's: 1792
SPLIT = 256 + 128 + 128 + 512 + 512 + 256 + 512  # 2304
PER_LAYER = REPLICATED + SPLIT  # 4096 = 512 + 384 + 384 + 512 + 768 + 768 + 768


def test_adapter_parameters_of_a_tiny_model_by_hand():
    arch = builtin_arch("tiny-demo")
    assert lora_layer_params(arch, 4, ALL) == (REPLICATED, SPLIT) == (1792, 2304)
    assert lora_params(arch, 4, ALL) == 2 * PER_LAYER == 8192
    assert lora_params_per_gpu(arch, 4, ALL, tp=1, pp=1) == 8192
    assert lora_params_per_gpu(arch, 4, ALL, tp=2, pp=1) == 2 * (1792 + 2304 / 2) == 5888
    assert lora_params_per_gpu(arch, 4, ALL, tp=2, pp=2) == 1792 + 2304 / 2  # one layer per stage
    # attention only: q 512 + k 384 + v 384 + o 512
    assert lora_params(arch, 4, ATTENTION) == 2 * 1792
    assert lora_params(arch, 8, ("q_proj",)) == 2 * (8 * 64 + 64 * 8)  # linear in the rank


# tiny-moe-demo: tiny-demo's attention (1792 per layer at rank 4: 1024 replicated, 768 split over tp),
# 2 MoE layers of 4 experts of width 64. One expert at rank 4: gate and up A 4*64 + B 64*4, down
# A 4*64 + B 64*4: 3 * 512 = 1536; a layer's 4 experts 6144.
EXPERT = 3 * (4 * 64 + 64 * 4)


def test_a_mixture_of_experts_model_gets_expert_adapters_by_hand():
    arch = builtin_arch("tiny-moe-demo")
    assert EXPERT == 1536
    assert lora_params(arch, 4, ALL) == 2 * (1792 + 4 * EXPERT) == 15872
    assert lora_params(arch, 4, ATTENTION) == 2 * 1792  # no expert adapters without gate/up/down
    assert lora_params(arch, 4, ("down_proj",)) == 2 * 4 * 512
    # tp 2, ep 2: every layer's replicated 1024, split 768 / 2, and 2 of its 4 experts
    assert lora_params_per_gpu(arch, 4, ALL, tp=2, pp=1, ep=2) == 2 * (1024 + 384 + 2 * EXPERT) == 8960
    assert lora_expert_params_per_gpu(arch, 4, ALL, tp=2, pp=1, ep=2) == 2 * 2 * EXPERT
    assert lora_params_per_gpu(arch, 4, ALL, tp=1, pp=2, ep=4) == 1792 + EXPERT  # one layer, one expert
    # a dense layer (HF mlp_only_layers) keeps the dense MLP's adapters: gate, up, down 768 each (ffn 128)
    mixed = dataclasses.replace(arch, dense_layers=(1,))
    assert lora_params(mixed, 4, ALL) == (1792 + 4 * EXPERT) + (1792 + 3 * 768) == 12032


# tiny-dsv3-demo: hidden 64, 3 layers (layer 0 dense, ffn 128; layers 1-2 MoE, 4 experts of width 64,
# one shared expert), multi-latent attention with 4 heads of v_head_dim 16 (head_dim 8, which o_proj
# does not read). Rank 4: o_proj in 4 * 16 = 64, out 64: A 256 (split over tp) + B 256 (replicated);
# layer 0's gate and up A 256 + B 128*4 = 512, down A 4*128 = 512 + B 256; an expert 1536 (EXPERT);
# the shared expert gets none (megarl/models/lora.py adapts the routed experts only).
DSV3_O, DSV3_DENSE_MLP = 256 + 256, 3 * 768
MLA_MODULES = ("o_proj", "gate_proj", "up_proj", "down_proj")


def test_multi_latent_attention_adapters_by_hand():
    arch = builtin_arch("tiny-dsv3-demo")
    assert lora_params(arch, 4, MLA_MODULES) == 3 * DSV3_O + DSV3_DENSE_MLP + 2 * 4 * EXPERT == 16128
    assert lora_params(arch, 4, ("o_proj",)) == 3 * DSV3_O  # heads x v_head_dim in, not heads x head_dim (32)
    # tp 2, ep 2: o_proj's A / 2, layer 0's MLP B's (gate, up) and down's A / 2, 2 of each MoE layer's 4 experts
    assert lora_params_per_gpu(arch, 4, MLA_MODULES, tp=2, pp=1, ep=2) == \
        3 * (256 + 128) + (256 + 256 + 256) + (512 + 512 + 512) / 2 + 2 * 2 * EXPERT == 8832  # fmt: skip
    assert lora_expert_params_per_gpu(arch, 4, MLA_MODULES, tp=2, pp=1, ep=2) == 2 * 2 * EXPERT


@pytest.mark.parametrize("modules", ["[q_proj, o_proj]", "[all-linear]"])
def test_lora_on_multi_latent_attention_refuses_q_k_v(modules):
    with pytest.raises(PlanError) as info:
        make_plan(load_config(TINY_DSV3, [f"actor.lora={{rank: 4, target_modules: {modules}}}"]))
    absent = "(q_proj, o_proj) names q_proj" if modules == "[q_proj, o_proj]" else "(all-linear) includes q_proj, k_proj, v_proj"
    line = next(x for x in str(info.value).splitlines() if "actor.lora.target_modules" in x)
    assert f"actor.lora.target_modules: {absent}, which LoRA cannot adapt on tiny-dsv3-demo (deepseek_v3" in line, line
    assert line.endswith("target any of o_proj, gate_proj, up_proj, down_proj"), line


def test_lora_on_deepseek_v3_plans_the_modules_it_has():
    p = make_plan(load_config(TINY_DSV3, ["actor.lora={rank: 4, target_modules: [o_proj, gate_proj, up_proj, down_proj]}"]))
    assert p is not None
    big = make_plan(load_config(DSV3, ["actor.lora={rank: 8, target_modules: [o_proj]}", "reference.offload=false"]))
    assert big.memory is not None


def test_expert_adapters_optimizer_state_is_sharded_like_the_experts():
    arch = builtin_arch("tiny-moe-demo")
    adapters = lora_params_per_gpu(arch, 4, ALL, tp=2, pp=1, ep=2)
    experts = lora_expert_params_per_gpu(arch, 4, ALL, tp=2, pp=1, ep=2)
    mem = train_memory(arch, tp=2, pp=1, dp=2, ep=2, tokens_per_micro_batch=64, dtype="bfloat16", recompute="none",
                       sequence_parallel=True, distributed_optimizer=True, lora_params=adapters,
                       lora_expert_params=experts)  # fmt: skip
    # the non-expert adapters over dp 2; the experts' over the expert-data-parallel group, tp x dp / ep = 2
    assert mem.optimizer == 12 * ((8960 - 6144) / 2 + 6144 / 2) == 12 * 4480
    assert mem.grads == 4 * 8960


def test_lora_memory_freezes_the_base_model():
    arch = builtin_arch("tiny-demo")
    common = dict(tp=2, pp=1, dp=2, tokens_per_micro_batch=64, dtype="bfloat16", recompute="none",
                  sequence_parallel=False, distributed_optimizer=True)  # fmt: skip
    full = train_memory(arch, **common)
    adapters = lora_params_per_gpu(arch, 4, ALL, tp=2, pp=1)
    lora = train_memory(arch, **common, lora_params=adapters)
    assert lora.weights == full.weights + 2 * adapters  # the whole model in bf16, plus the adapters
    assert lora.grads == 4 * adapters  # fp32 grad buffer of the adapters only
    assert lora.optimizer == 12 * adapters / 2  # fp32 main copy + Adam's two moments, over dp 2
    assert lora.optimizer_at_build == 4 * adapters / 2
    assert lora.head_grad == 0 and full.head_grad > 0  # the output layer is frozen
    assert (lora.activations, lora.logits) == (full.activations, full.logits)
    fp32 = train_memory(
        arch, **common | {"dtype": "float32", "distributed_optimizer": False}, lora_params=adapters
    )
    assert fp32.optimizer == 8 * adapters  # fp32 weights are their own master copy; not sharded


def test_shipped_lora_config_fits_one_node_with_no_reference_model():
    p = make_plan(load_config(LORA72))
    assert len(p.roles["policy"].gpus) == 8 and p.memory is not None
    mem = p.memory
    assert "reference/weights" not in mem.states and mem.reference_weights == 0
    assert "reference_forward" in mem.phases  # the policy's forward, adapters off
    pol = mem.policy
    assert pol is not None
    adapters = lora_params_per_gpu(p.arch, 32, ALL, tp=8, pp=1)
    assert pol.grads == 4 * adapters and pol.optimizer == 12 * adapters
    assert pol.weights / GIB == pytest.approx(17.3, abs=0.1) and pol.optimizer / GIB < 2.5
    full = make_plan(load_config(GRPO72)).memory
    assert (
        full is not None and full.policy is not None and full.policy.optimizer > 10 * pol.optimizer
    )  # on 4x the GPUs
    with pytest.raises(
        PlanError, match="actor: training needs"
    ):  # full fine-tuning does not fit the node
        make_plan(load_config(LORA72, ["actor.lora=null"]))


def test_a_checkpoint_gathers_the_adapters_state_only():
    arch = builtin_arch("qwen2.5-72b")
    adapters = lora_params_per_gpu(arch, 32, ALL, tp=8, pp=1)
    assert save_gather_host_bytes(arch, tp=8, pp=1, lora_params=adapters) == 12 * adapters
    assert (
        save_gather_host_bytes(arch, tp=8, pp=1) > 40 * 12 * adapters
    )  # the whole stage's fp32 state


def test_an_adapter_push_carries_the_adapters_only():
    arch = builtin_arch("qwen2.5-72b")
    merged = push_estimate(load_config(LORA72), arch, tp=8, pp=1, dp=1)
    assert merged.parts == (
        ("TP gather", 2 * arch.num_params * 7 / 8, "nvlink"),
    )  # the whole model
    engine = RoleLayout("rollout", 8, 1, 1, tuple(range(8)))  # on policy rank 0's node
    adapter = push_estimate(
        load_config(LORA72, ["rollout.weight_sync.lora=adapter"]), arch, tp=8, pp=1, dp=1, rollout=engine
    )
    replicated, split = lora_layer_params(arch, 32, ALL)
    assert adapter.parts[0] == ("TP gather", 2 * 80 * split * 7 / 8, "nvlink")  # only the split halves are gathered
    assert 2 * 80 * (replicated + split) == 2 * lora_params(arch, 32, ALL) == 2 * 421_068_800
    # the tensor transport's merged push crosses NVLink only; the adapters' directory the host link
    assert sum(b for _, b, _ in adapter.parts) < sum(b for _, b, _ in merged.parts) / 40


@pytest.mark.parametrize(("overrides", "local", "remote"), [
    (["cluster.nnodes=1"], 1, 0),  # one node: the engine reads the directory
    (["cluster.nnodes=2", "cluster.placement=disaggregated", "cluster.rollout_gpus=8"], 0, 1),  # engine on node 1
    (["cluster.nnodes=2"], 1, 1),  # colocated on 2 nodes: one engine per node
])  # fmt: skip
def test_an_adapter_push_counts_the_directory_and_each_remote_servers_request(overrides, local, remote):
    # a server on another node gets one base64 copy (4/3 of the bytes) per engine TP rank: at 72B,
    # rank 32 and rollout.tp 8, 0.842 GB of adapters make 8.98 GB per server and push
    cfg = load_config(LORA72, ["rollout.weight_sync.lora=adapter", *overrides])
    push = make_plan(cfg).push
    assert push is not None and push.transport == "adapter"
    arch = builtin_arch("qwen2.5-72b")
    adapters = 2 * lora_params(arch, 32, ALL)  # bf16
    assert adapters == 842_137_600
    expected = [("TP gather", 2 * 80 * lora_layer_params(arch, 32, ALL)[1] * 7 / 8, "nvlink")]
    if local:
        expected += [("PEFT directory written by policy rank 0", adapters, "host"),
                     (f"read by the {local} server{'s' * (local > 1)} on its node", local * adapters, "host")]  # fmt: skip
    if remote:
        expected.append((f"requests to the {remote} server{'s' * (remote > 1)} on other nodes", remote * adapters * 4 / 3 * 8, "network"))
    assert [(name.split(" (")[0], link) for name, _, link in push.parts] == [(name, link) for name, _, link in expected]
    assert [b for _, b, _ in push.parts] == pytest.approx([b for _, b, _ in expected])
    cl = cfg.cluster
    bandwidth = {"nvlink": cl.nvlink_gb_per_s, "host": cl.host_gb_per_s, "network": cl.network_gb_per_s}
    assert push.seconds == pytest.approx(sum(b / (bandwidth[link] * 1e9) for _, b, link in expected))


def test_auto_layer_spec_resolves_to_local_with_lora():
    p = make_plan(load_config(LORA72, ["model.layer_spec=auto"]))
    assert p.resolved == {"model.layer_spec": "local"}
    assert (
        make_plan(load_config(GRPO72, ["model.layer_spec=auto"])).resolved == {}
    )  # full fine-tuning: te may do
    assert make_plan(load_config(TINY, ["actor.lora={rank: 4}", "model.layer_spec=auto"]), sft=True).resolved == {
        "model.layer_spec": "local"}  # fmt: skip


@pytest.mark.parametrize(("path", "overrides", "expected"), [
    (LORA72, ["critic.lora={rank: 8}"], "critic.lora: LoRA trains the policy only"),
    (LORA72, ["actor.lora.dropout=0.1"], "actor.lora.dropout: (0.1) needs actor.parallel.tp=1 and tp is 8"),
    (TINY, ["actor.lora={rank: 4}", "rollout.weight_sync.lora=adapter"],
     "rollout.weight_sync.lora: (adapter) needs SGLang's LoRA serving and rollout.engine is torch; use "
     "rollout.weight_sync.lora=merged"),
    (MOE30, ["actor.lora={rank: 8}", "rollout.weight_sync.lora=adapter"],
     "rollout.weight_sync.lora: (adapter) cannot carry the adapters on qwen3-30b-a3b's experts (gate_proj, up_proj, "
     "down_proj: an HF PEFT adapter cannot hold them); use rollout.weight_sync.lora=merged"),
    (MOE30, ["actor.lora={rank: 8}", "actor.parallel.etp=2"],
     "actor.parallel.etp: (2) splits each expert, and actor.lora adapts the experts (gate_proj, up_proj, down_proj), "
     "whose adapters need them whole; set etp to 1"),
    (LORA72, ["model.layer_spec=te"], "model.layer_spec: (te) fuses the norm into the QKV and fc1 linears"),
])  # fmt: skip
def test_lora_checks_refuse(path, overrides, expected):
    with pytest.raises(PlanError) as info:
        make_plan(load_config(path, overrides))
    assert expected in str(info.value)


def test_lora_checks_pass_and_warn():
    assert (
        make_plan(load_config(TINY, ["actor.lora={rank: 4, dropout: 0.1}"])) is not None
    )  # dropout at tp 1
    moe = make_plan(
        load_config(MOE30, ["actor.lora={target_modules: [all-linear]}", "reference.offload=false"])
    )
    assert not moe.warnings  # all-linear on MoE: the attention and every expert
    explicit = make_plan(load_config(MOE30, ["actor.lora={target_modules: [q_proj, up_proj, down_proj]}",
                                             "reference.offload=false"]))  # fmt: skip
    assert not explicit.warnings
    unused = make_plan(load_config(GRPO72, ["rollout.weight_sync.lora=adapter"]))
    assert any(
        str(w).startswith("rollout.weight_sync.lora: (adapter) applies with actor.lora only")
        for w in unused.warnings
    )
    offloaded = make_plan(
        load_config(GRPO72, ["actor.lora={rank: 8}"])
    )  # it sets reference.offload
    assert any(
        str(w).startswith("reference.offload: (true) moves nothing with actor.lora")
        for w in offloaded.warnings
    )


def test_the_report_says_lora_is_on():
    cfg = load_config(LORA72, ["rollout.weight_sync.lora=adapter"])
    console = Console(record=True, width=500)
    print_plan(cfg, make_plan(cfg), console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("LoRA "))
    assert line.startswith(
        "LoRA rank 32, alpha 64 (scale 2), modules q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj; trainable 421M params (0.58% of the model's 72.7B), base frozen; no reference model"
    )
    assert "push adapter: the adapters only, 0.842 GB" in line and "model.layer_spec local" in line
    # rank 64 on every module of the tiny MoE model: the adapters outgrow it (the line said "2e+02%")
    tiny = load_config(TINY_MOE, ["actor.lora.rank=64"])
    console = Console(record=True, width=500)
    print_plan(tiny, make_plan(tiny), console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("LoRA "))
    assert "trainable 254K params (202% of the model's 126K: the adapters are larger than the model), base frozen" in line
    moe = load_config(MOE30, ["actor.lora={rank: 8}"])
    console = Console(record=True, width=500)
    print_plan(moe, make_plan(moe), console)
    assert (
        "modules q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (gate_proj, up_proj, down_proj on "
        "each of the 128 experts of the MoE layers)" in console.export_text()
    )  # fmt: skip


def test_a_rank_past_the_modules_width_is_warned():
    # rank 512 on the tiny model (hidden 64; k and v out 2 kv heads x 16 = 32) ran with no word, the
    # report saying the adapters were 3.4e+02 % of the model
    def rank_warnings(*overrides):
        return [str(w) for w in make_plan(load_config(TINY, list(overrides))).warnings if str(w).startswith("actor.lora.rank")]

    (warning,) = rank_warnings("actor.lora.rank=512")
    # the model is named by its directory once `megarl demo` has built it there, else by model.arch
    assert re.match(r"actor.lora.rank: \(512\) exceeds the 32 features of k_proj on (tiny-demo|outputs/demo/model) "
                    r"\(hidden size 64\): an adapter's update B A has rank at most min\(in, out\)", warning)
    assert warning.endswith("set actor.lora.rank to 32 or less")
    assert rank_warnings("actor.lora.rank=32") == []
    assert rank_warnings("actor.lora={rank: 64, target_modules: q_proj}") == []  # q: 64 in, 64 out
    assert "exceeds the 64 features of q_proj" in rank_warnings("actor.lora={rank: 65, target_modules: q_proj}")[0]


def test_a_lora_checkpoint_stages_the_adapters_and_their_optimizer_state_only():
    # The staging counted the whole policy (154 GiB on the 72B node), refusing the config at 200 GiB.
    p = make_plan(load_config(LORA72, ["cluster.host_memory_gib=200"]))
    assert p.memory is not None and p.memory.host is not None
    host, states = p.memory.host, p.memory.states
    adapters = lora_params_per_gpu(p.arch, 32, ALL, tp=8, pp=1)  # 181M per GPU (tp 8, dp 1)
    # each of the node's 8 ranks is the first of its (size-1) data-parallel group: it writes its
    # adapters in bf16 and its shard of the dp_reshardable optimizer state (fp32 main copy + 2 moments)
    assert host.save_staging == {"policy": pytest.approx(8 * (2 * adapters + 12 * adapters))}
    assert host.save_staging["policy"] / GIB == pytest.approx(18.9, abs=0.1)
    # the offloaded copies are what the residency table moves: colocated SGLang's launch moves the
    # whole policy off the GPUs (base weights + the adapters' optimizer state), actor.offload or not
    assert host.offloaded == {"policy": pytest.approx(8 * (states["policy/weights"] + states["policy/optimizer"]))}
    assert host.peak / GIB == pytest.approx(154.3 + 18.9, abs=0.2) and host.peak < 200 * GIB
    full = make_plan(load_config(GRPO72)).memory
    assert full is not None and full.host is not None
    assert full.host.save_staging["policy"] > 10 * host.save_staging["policy"]  # the whole model's shard is written there
