"""Each planner check: a good config passes, a bad one fails naming the field and a fix."""

import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from megarl.config.loading import load_config
from megarl.plan.gpu_memory import GIB
from megarl.plan.host_memory import save_staging_host_bytes
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.report import print_plan
from megarl.plan.rollout_checks import check_server_python

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
GRPO72 = CONFIGS / "qwen72b_grpo.yaml"
PPO7 = CONFIGS / "qwen2.5_7b_ppo.yaml"
TINY = CONFIGS / "tiny_grpo.yaml"
AGENT = CONFIGS / "gsm8k_tool_agent.yaml"
MOE30 = CONFIGS / "qwen3_30b_a3b_grpo.yaml"
MOE235 = CONFIGS / "qwen3_235b_a22b_grpo.yaml"
DSV3 = CONFIGS / "deepseek_v3_grpo.yaml"
TINY_DSV3 = CONFIGS / "tiny_dsv3_grpo.yaml"
LORA72 = CONFIGS / "qwen72b_grpo_lora.yaml"


def _printed(cfg) -> str:
    console = Console(record=True, width=400)
    print_plan(cfg, make_plan(cfg), console)
    return console.export_text()


def plan(path, *overrides):
    return make_plan(load_config(path, list(overrides)))


def refused(path, *overrides) -> str:
    with pytest.raises(PlanError) as info:
        plan(path, *overrides)
    return str(info.value)


@pytest.mark.parametrize("path", [GRPO72, PPO7, TINY, AGENT, MOE30, MOE235, DSV3, TINY_DSV3, LORA72], ids=lambda p: p.name)
def test_shipped_configs_plan(path):
    p = plan(path)
    assert p.roles["policy"].tp * p.roles["policy"].pp * p.roles["policy"].dp == len(p.roles["policy"].gpus)


def test_layout_derives_dp_and_placement():
    p = plan(GRPO72)
    pol, roll = p.roles["policy"], p.roles["rollout"]
    assert (pol.tp, pol.pp, pol.dp) == (8, 4, 1)
    assert roll.dp == 4 and roll.tp == 8
    rows = p.rows(4, 8)
    assert len(rows) == 32
    assert rows[9] == (1, 1, "policy tp1 pp1 dp0; rollout engine 1 tp1")
    p = plan(PPO7)
    assert p.roles["critic"].dp == 4 and p.roles["policy"].dp == 4


def test_disaggregated_pools():
    p = plan(PPO7, "cluster.placement=disaggregated", "cluster.nnodes=2", "cluster.rollout_gpus=8")
    assert p.roles["policy"].gpus == tuple(range(8)) and p.roles["policy"].dp == 4
    assert p.roles["critic"].gpus == tuple(range(8))
    assert p.roles["rollout"].gpus == tuple(range(8, 16)) and p.roles["rollout"].dp == 4
    # pools are placed node by node: a pool of 12 GPUs on 8-GPU nodes cannot be
    assert "must be whole nodes" in refused(PPO7, "cluster.placement=disaggregated", "cluster.nnodes=2", "cluster.rollout_gpus=4")
    assert "the torch engine lives inside the policy ranks" in refused(
        TINY, "cluster.placement=disaggregated", "cluster.rollout_gpus=1", "actor.micro_batch_size=1")
    assert "rollout_gpus" in refused(GRPO72, "cluster.placement=disaggregated")


def test_tp_must_divide_heads():
    msg = refused(GRPO72, "actor.parallel.tp=3")
    # at pp 4, tp 1 and 2 would divide the heads too, but hold too much per GPU
    assert "actor.parallel.tp: (3) must divide num_attention_heads (64) and num_key_value_heads (8); try 4 or 8" in msg


def test_tp_must_divide_query_groups():
    msg = refused(PPO7, "actor.parallel.tp=7", "cluster.gpus_per_node=7")  # 28 heads, 4 kv heads
    assert "num_key_value_heads (4)" in msg


def test_pp_must_divide_layers():
    assert "actor.parallel.pp: (3) must divide num_layers (80)" in refused(GRPO72, "actor.parallel.pp=3")


def test_world_must_be_a_multiple_of_tp_pp():
    assert "tp x pp (8 x 4 = 32) must divide the 24 GPUs" in refused(GRPO72, "cluster.nnodes=3")


def errors_of(path, *overrides) -> list[str]:
    """The refusal's lines (none when the plan passes)."""
    try:
        plan(path, *overrides)
    except PlanError as exc:
        return [str(i) for i in exc.issues]
    return []


def suggested(message: str, after: str) -> list[int]:
    """The values of ``after`` ``1, 2 or 4`` in ``message``."""
    match = re.search(re.escape(after) + r" ((?:\d+, )*\d+(?: or \d+)?)", message)
    assert match, message
    return [int(v) for v in re.findall(r"\d+", match.group(1))]


@pytest.mark.parametrize(("path", "knob", "bad", "field", "after"), [
    (GRPO72, "actor.parallel.pp", 3, "actor.parallel.pp", "try"),  # divides the layers, and 8 x pp the 32 GPUs
    (GRPO72, "actor.parallel.pp", 5, "actor.parallel", "try pp"),
    (GRPO72, "actor.parallel.tp", 3, "actor.parallel.tp", "try"),
    (GRPO72, "rollout.tp", 3, "rollout.tp", "try"),  # the pool, a node, the heads, and the weights in mem_fraction
    (TINY, "actor.mini_batch_size", 100, "actor.mini_batch_size", "try"),  # the step, and dp x micro_batch_size
    (TINY, "actor.mini_batch_size", 64, "actor.mini_batch_size", "try actor.mini_batch_size"),
    (TINY, "actor.micro_batch_size", 48, "actor.mini_batch_size", "try actor.micro_batch_size"),
])
def test_each_suggested_value_passes_every_rule_it_touches(path, knob, bad, field, after):
    message = next(e for e in errors_of(path, f"{knob}={bad}") if e.startswith(f"{field}: "))
    values = suggested(message, after)
    assert values, message
    fixed = knob if "micro_batch_size" not in after else "actor.micro_batch_size"
    for v in values:
        assert errors_of(path, f"{knob}={bad}", f"{fixed}={v}") == [], (message, v)


@pytest.mark.parametrize(("overrides", "field"), [
    (["actor.parallel.tp=1", "actor.parallel.pp=1"], "actor"),  # over the memory: the layouts that fit, not more GPUs
    # in the update, with its other knobs (one row per micro-batch: at 16k tokens no layout fits)
    (["actor.parallel.tp=2", "actor.parallel.pp=2", "actor.recompute=none", "actor.max_tokens_per_gpu=null",
      "actor.micro_batch_size=1"], "actor"),
    (["actor.parallel.tp=5", "actor.parallel.pp=1"], "actor.parallel.tp"),  # no tp fits at pp 1: whole layouts
])
def test_each_suggested_layout_passes_every_rule(overrides, field):
    message = next(e for e in errors_of(GRPO72, *overrides) if e.startswith(f"{field}: "))
    assert "raise the GPU count" not in message
    layouts = re.findall(r"(\d+) x (\d+)(?! =)", message.split("try ")[-1].split("; ")[-1])
    assert layouts, message
    for tp, pp in layouts:
        assert errors_of(GRPO72, *overrides, f"actor.parallel.tp={tp}", f"actor.parallel.pp={pp}") == [], (message, tp, pp)


def test_sequence_parallel_is_on_when_tp_is_above_1_and_shrinks_the_activations():
    on, off = plan(GRPO72), plan(GRPO72, "actor.parallel.sequence_parallel=false")
    cfg = load_config(GRPO72, ["actor.parallel.tp=1", "actor.parallel.pp=8", "actor.parallel.sequence_parallel=true"])
    assert cfg.actor.parallel.uses_sequence_parallel is False  # nothing to split at tp 1
    warnings = plan(TINY, "actor.parallel.sequence_parallel=true").warnings  # tp 1
    assert "actor.parallel.sequence_parallel: (true) has no effect at tp 1" in " ".join(map(str, warnings))
    unset = load_config(GRPO72, [])
    assert unset.actor.parallel.sequence_parallel is None and unset.actor.parallel.uses_sequence_parallel  # tp 8
    assert "dp1 sp recompute full, rollout" in _printed(unset)  # the config's explicit recompute, printed too
    # Norms and residuals hold 1/tp of the sequence: less activation memory, nothing else changes.
    assert on.memory.policy.activations < off.memory.policy.activations
    assert on.memory.policy.states == off.memory.policy.states


@pytest.mark.parametrize("knob", ["vpp", "cp"])
def test_out_of_scope_parallelism_is_refused(knob):
    assert f"actor.parallel.{knob}" in refused(GRPO72, f"actor.parallel.{knob}=2")
    assert "not supported yet" in refused(GRPO72, f"actor.parallel.{knob}=2")


@pytest.mark.parametrize("knob", ["ep", "etp"])
def test_a_dense_model_refuses_expert_parallelism_by_field(knob):
    assert f"actor.parallel.{knob}: (2) splits the experts of a mixture-of-experts model and qwen2.5-72b is dense; " \
        "set it to 1" in refused(GRPO72, f"actor.parallel.{knob}=2")


def _moe_dir(tmp_path, experts: int = 4) -> str:
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
        f'"num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "num_experts": {experts}, '
        '"num_experts_per_tok": 2, "moe_intermediate_size": 32}'
    )
    return f"model.path={tmp_path}"


def _moe_issues(*overrides: str) -> list[str]:
    """The plan's issues of the trained sections, errors or (when it passes) warnings, one per line."""
    try:
        issues = plan(TINY, *overrides).warnings
    except PlanError as exc:
        issues = exc.issues
    return [str(i) for i in issues if i.field.startswith(("actor.", "critic."))]


def test_expert_parallelism_of_an_moe_model_follows_megatrons_rules(tmp_path):
    model = _moe_dir(tmp_path)
    assert _moe_issues(model, "actor.parallel.ep=2") == []  # ep 2 over tp 1 x dp 2
    assert _moe_issues(model, "actor.parallel.tp=2", "actor.micro_batch_size=32", "actor.parallel.ep=2") == []
    too_many = _moe_issues(model, "actor.parallel.ep=4", "actor.parallel.tp=1")  # 4 divides the experts, not tp x dp
    assert too_many == ["actor.parallel.ep: (4) must divide num_experts (4) and, times etp (1), tp x dp (1 x 2 = 2): the "
                        "expert-parallel groups lie across the tensor- and data-parallel ranks; try 1 or 2"]
    assert "actor.parallel.ep: (3) must divide num_experts (4)" in _moe_issues(model, "actor.parallel.ep=3")[0]
    assert _moe_issues(model, "actor.parallel.etp=2", "actor.parallel.tp=2", "actor.micro_batch_size=32") == []  # etp = tp
    wrong = "at ep 1 Megatron trains the experts as dense parameters and reduces their gradients over the data-parallel " \
        "group only, which is right only when the experts split as the tensor-parallel layers do"
    assert _moe_issues(model, "actor.parallel.etp=2") == [  # etp 2 over dp 2 at tp 1: wrong gradients, silently
        f"actor.parallel.etp: (2) with ep 1 must equal tp (1): {wrong}; set etp to 1, or tp to 2"]  # no ep x 2 tiles 2
    assert _moe_issues(model, "actor.parallel.tp=2", "actor.micro_batch_size=32") == [  # each TP rank's experts apart
        f"actor.parallel.etp: (1) with ep 1 must equal tp (2): {wrong}; set etp to 2, or tp to 1, or ep to 2"]
    # ep 1 would tile tp x dp at etp 2, but not at tp 1: the fix names whole experts, or tp = etp at ep 1
    assert _moe_issues(model, "actor.parallel.etp=2", "actor.parallel.ep=2") == [
        "actor.parallel.ep: (2) must divide num_experts (4) and, times etp (2), tp x dp (1 x 2 = 2): the expert-parallel "
        "groups lie across the tensor- and data-parallel ranks; try etp 1 (at ep 2), or tp 2 with ep 1"]
    assert _moe_issues(model, "actor.parallel.etp=2", "actor.parallel.ep=2", "actor.parallel.tp=2",
                       "actor.micro_batch_size=32") == [
        "actor.parallel.ep: (2) must divide num_experts (4) and, times etp (2), tp x dp (2 x 1 = 2): the expert-parallel "
        "groups lie across the tensor- and data-parallel ranks; try 1"]
    assert [i for i in _moe_issues(model, "actor.parallel.etp=3", "cluster.gpus_per_node=3") if ".etp" in i] == [
        "actor.parallel.etp: (3) must divide moe_intermediate_size (32): expert tensor parallelism splits each expert's "
        "gate/up rows and down columns; try 1 (at ep 1)"]  # the divisors of 32 that also suit ep 1 at tp 1
    no_sp = _moe_issues(model, "actor.parallel.tp=2", "actor.micro_batch_size=32", "actor.parallel.sequence_parallel=false",
                        "actor.parallel.etp=2")
    assert no_sp == ["actor.parallel.sequence_parallel: (false) at tp 2: Megatron's MoE layers train only with sequence "
                     "parallelism when tp > 1; remove it (on by default) or set it true"]


def test_moe_settings_on_a_dense_model_are_refused_by_key():
    assert "actor.moe.aux_loss_coef: (0.01) applies to mixture-of-experts models and qwen2.5-72b is dense; remove it" \
        in refused(GRPO72, "actor.moe.aux_loss_coef=0.01")
    assert "actor.moe.routing_replay: (experts) applies to mixture-of-experts models" in refused(GRPO72, "actor.moe.routing_replay=experts")


def test_replayed_routing_weights_need_the_torch_engine():
    msg = refused(GRPO72, "model.arch=qwen3-30b-a3b", "actor.moe.routing_replay=experts_and_weights")
    assert "actor.moe.routing_replay: (experts_and_weights) needs the engine's routing weights and SGLang returns expert " \
        "ids only; use experts (the trainer's own weights over the engine's experts), or rollout.engine torch" in msg
    assert "routing_replay" not in refused(GRPO72, "model.arch=qwen3-30b-a3b", "actor.moe.routing_replay=experts")


def test_moe_training_plans_and_a_capacity_factor_warns(tmp_path):
    model = _moe_dir(tmp_path)
    assert _moe_issues(model, "actor.moe.routing_replay=experts_and_weights") == []  # the torch engine reports weights
    assert _moe_issues(model, "actor.moe.capacity_factor=1.25") == [
        "actor.moe.capacity_factor: (1.25) drops the tokens an over-full expert cannot take, and the engine drops none: "
        "those tokens' log-probs differ between trainer and engine (a growing mismatch); remove it to train dropless"]


def test_what_the_moe_update_cannot_do_yet_is_refused_before_launch(tmp_path):
    model = _moe_dir(tmp_path)
    assert _moe_issues(model, "actor.moe.expert_bias_update_rate=0.001") == [
        f"actor.moe.expert_bias_update_rate: (0.001) moves a router's correction bias (DeepSeek-V3's "
        f"e_score_correction_bias) and {tmp_path}'s router has none; remove it, or balance with aux_loss_coef"]
    assert _moe_issues(model, "actor.moe.z_loss_coef=0.01", "actor.moe.aux_loss_coef=0.01", "actor.parallel.pp=2") == []
    gae = ("algorithm.estimator=gae", "critic.moe.routing_replay=experts")
    assert _moe_issues(model, *gae) == [
        "critic.moe.routing_replay: (experts) replays the routing the rollout returns, and the rollout asks the engines "
        "for it only with actor.moe.routing_replay set; set both, or neither"]
    assert _moe_issues(model, *gae, "actor.moe.routing_replay=experts") == []


def test_moe_configs_print_where_the_experts_live():
    out = _printed(load_config(MOE30, []))
    assert "policy: tp2 pp1 dp16 sp recompute full" in out
    # Megatron's expert order: ep ranks run over consecutive ranks of a stage (tp fastest), 16 experts each
    assert "policy tp0 pp0 dp0 ep0 experts 0-15; rollout engine 0 tp0" in out
    assert "policy tp1 pp0 dp15 ep7 experts 112-127; rollout engine 7 tp3" in out
    assert "experts policy: 128 per MoE layer over ep 8 x etp 1, 16 whole experts per GPU; expert-data-parallel 4" in out
    assert "node 3: pp0 ep 0-7 (experts 0-127)" in out  # every node holds every expert once
    assert "experts rollout: each of the 8 engines splits every expert over its tp 4 (192 of its 768" in out
    assert "EP gather" in out and "ok: the plan fits" in out
    big = _printed(load_config(MOE235, []))
    # ep 32 at tp 4 x dp 16 per stage: a node holds a quarter of the experts, each twice per stage
    assert "node 1: pp0 ep 8-15 (experts 32-63)" in big and "node 12: pp1 ep 0-7 (experts 0-31)" in big
    assert "expert-data-parallel 2" in big


def test_deepseek_v3_config_prints_its_experts_and_mla_memory():
    out = _printed(load_config(DSV3, []))
    assert "policy tp0 pp0 dp0 ep0 experts 0-3; rollout engine 0 tp0" in out
    assert "experts policy: 256 per MoE layer over ep 64 x etp 1, 4 whole experts per GPU; expert-data-parallel 4" in out
    assert "node 8: pp0 ep 0-7 (experts 0-31)" in out  # 8 nodes hold every expert once
    assert "experts rollout: each of the 32 engines splits every expert over its tp 8 (256 of its 2048" in out
    assert "weights 156.2 + KV cache" in out and "ok: the plan fits" in out
    assert "model deepseek-v3 (deepseek_v3, 671.03B params, 61 layers, 128 heads / 128 kv, vocab 129280); its 1 " \
        "multi-token-prediction layer not counted, not trained" in out
    p = plan(DSV3)
    # the rollout's KV per token is MLA's latent: 61 x 576 x 2 bytes, on every GPU of an engine
    assert p.memory.rollout.kv_bytes_per_token == 70_272
    # a 140 GiB H200 cannot hold a one-node engine's bf16 weights
    assert "less than the engine's weights (156.2 GiB at rollout.tp=8)" in refused(DSV3, "cluster.gpu_memory_gib=140")
    assert plan(DSV3, "actor.moe.expert_bias_update_rate=0.001").warnings == p.warnings  # the router has the bias
    # the engine's weights replay on its router too (the torch engine's: SGLang returns expert ids only)
    weights = plan(TINY_DSV3, "actor.moe.routing_replay=experts_and_weights")
    assert weights.arch.router_bias and not [i for i in weights.warnings if "routing_replay" in i.field]
    # SGLang 0.5.23's CPU server dies loading it (its MLA rope on CPU asserts rope_scaling): refused before launch
    sglang_cpu = ("rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3", "cluster.rollout_gpus=1")
    assert "rollout.engine: (sglang) cannot serve deepseek_v3 on CPU" in refused(TINY_DSV3, *sglang_cpu)


def _dsv3_config(path, rope_scaling: dict) -> str:
    """A tiny DeepSeek-V3 config.json alone (the plan reads nothing else of it)."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 32,
              "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
              "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
              "n_shared_experts": 1, "vocab_size": 1000, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 256, "rope_theta": 10000.0,
              "rope_scaling": rope_scaling}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_rope_scaling_the_bridge_refuses_is_refused_by_the_plan_by_name(tmp_path):
    """yarn without its factor: the bridge's own words, before the tokenizer's (transformers refuses
    the same config.json in words of its own) and without torch (megarl/models/rope.py)."""
    import json

    yarn = {"type": "yarn", "original_max_position_embeddings": 64}
    model = _dsv3_config(tmp_path / "no_factor", yarn)
    assert (f"model.path: ({model}) is not a model megarl can train: HF config yarn rope scaling lacks factor; fix the "
            f"rope settings in {model}/config.json") in refused(TINY_DSV3, f"model.path={model}", "model.arch=null")
    plan(TINY_DSV3, f"model.path={_dsv3_config(tmp_path / 'factor', yarn | {'factor': 4.0})}", "model.arch=null")
    # a dense model's bridge takes no yarn (Megatron's plain attention has none)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                                                   "vocab_size": 100, "rope_scaling": yarn | {"factor": 4.0}}))  # fmt: skip
    assert "HF config rope_type='yarn' is not supported; supported: default, linear, llama3" in refused(TINY, f"model.path={dense}")


def test_moe_memory_shards_experts_over_ep():
    """The 30B model's experts over ep 8 (etp 1) hold 4 times less than over ep 1 and etp 2 (at ep 1
    etp must equal tp; dp 16 either way); the dense share does not move."""
    big = "cluster.gpu_memory_gib=1000"  # room for every expert on each GPU
    moe = plan(MOE30, big).memory.policy
    whole = plan(MOE30, big, "actor.parallel.ep=1", "actor.parallel.etp=2").memory.policy
    arch = plan(MOE30).arch
    expert_bytes = 2 * arch.num_moe_layers * arch.num_experts * arch.expert_params
    assert whole.weights - moe.weights == pytest.approx(expert_bytes * (1 / 2 - 1 / 8))
    assert moe.optimizer == pytest.approx(whole.optimizer)  # sharded over 32 ranks either way


def test_sglang_splits_each_expert_over_its_tp(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, '
        '"num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 1024, "vocab_size": 1000, "num_experts": 8, '
        '"num_experts_per_tok": 2, "moe_intermediate_size": 20}'
    )
    msg = refused(GRPO72, f"model.path={tmp_path}", "actor.parallel.ep=8")
    assert "rollout.tp: (8) must divide moe_intermediate_size (20): SGLang splits each expert over the engine's TP " \
        "ranks; try 1, 2 or 4" in msg  # (5 divides 20, not a node of 8)


def test_flex_attention_needs_cuda_packing_and_the_local_spec():
    assert plan(PPO7, "actor.packed_attention=flex", "critic.packed_attention=flex", "model.layer_spec=local").warnings == []
    cpu = refused(TINY, "actor.packed_attention=flex")
    assert "actor.packed_attention: (flex) needs CUDA and cluster.device is cpu" in cpu and "use auto" in cpu
    padded = refused(PPO7, "critic.packed_attention=flex", "critic.pack_sequences=false")
    assert "critic.packed_attention: (flex) attends packed micro-batches and critic.pack_sequences is false" in padded
    te = refused(PPO7, "actor.packed_attention=flex", "model.layer_spec=te")
    assert "actor.packed_attention: (flex) replaces the local spec's attention and model.layer_spec is te" in te
    auto = plan(PPO7, "actor.packed_attention=flex", "model.layer_spec=auto").warnings
    assert [w.field for w in auto] == ["actor.packed_attention"] and "set model.layer_spec local" in auto[0].message


def test_experts_without_an_moe_bridge_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_experts": 8}'
    )
    assert f"model: {tmp_path} has 8 experts and megarl's qwen2 bridge is dense; mixture-of-experts bridges: " \
        "qwen3_moe" in refused(TINY, f"model.path={tmp_path}")


def test_local_config_json_is_used(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}'
    )
    assert plan(TINY, f"model.path={tmp_path}").arch.num_layers == 3
    assert "pp: (2) must divide num_layers (3)" in refused(TINY, f"model.path={tmp_path}", "actor.parallel.pp=2")


def test_rollout_tp_rules():
    assert "rollout.tp: (16) must divide gpus_per_node (8) so that no engine spans two nodes" in refused(GRPO72, "rollout.tp=16")
    assert "must divide gpus_per_node (6)" in refused(GRPO72, "rollout.tp=4", "cluster.gpus_per_node=6", "actor.parallel.pp=2",
                                                      "actor.parallel.tp=4", "actor.mini_batch_size=128")
    assert "rollout.tp: (3) must divide the 32 GPUs" in refused(GRPO72, "rollout.tp=3")
    # 28 heads, 4 kv heads: tp 7 divides the heads and is not a multiple of 4 -> refused
    assert "rollout.tp: (7) must divide num_attention_heads (28)" in refused(PPO7, "rollout.tp=7", "cluster.gpus_per_node=7", "actor.parallel.tp=1", "critic.parallel.tp=1", "actor.mini_batch_size=56", "critic.mini_batch_size=56", "data.prompts_per_step=56", "actor.micro_batch_size=1", "critic.micro_batch_size=1")
    assert plan(GRPO72, "rollout.tp=4").roles["rollout"].dp == 8
    assert "must be 1 with the torch engine" in refused(TINY, "rollout.tp=2")
    assert "SGLang on cpu runs as a server of its own" in refused(TINY, "rollout.engine=sglang")
    # On CPU it runs disaggregated, weights over a gloo broadcast (the demo's placement).
    cpu = plan(TINY, "rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3",
               "cluster.rollout_gpus=1")  # fmt: skip
    assert (cpu.roles["policy"].dp, cpu.roles["rollout"].dp) == (2, 1)


def test_weight_transport_must_reach_the_engines():
    assert "transport: (tensor) cannot reach torch engines placed colocated; use in_process or disk" in refused(
        TINY, "rollout.weight_sync.transport=tensor")
    assert "(distributed) cannot reach sglang engines placed colocated; use tensor or disk" in refused(
        GRPO72, "rollout.weight_sync.transport=distributed")
    assert "(tensor) cannot reach sglang engines placed disaggregated; use distributed or disk" in refused(
        GRPO72, "rollout.weight_sync.transport=tensor", "cluster.nnodes=5", "cluster.placement=disaggregated",
        "cluster.rollout_gpus=8")
    plan(TINY, "rollout.weight_sync.transport=disk")  # any engine can reload from disk


def test_server_args_that_make_sglang_force_nccl_cumem_are_refused(monkeypatch):
    """SGLang sets NCCL_CUMEM_ENABLE=1 in its server under --enable-symm-mem even when it is set,
    while the policy ranks keep the run's value (0): the distributed push's NCCL group fails."""
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    disaggregated = (PPO7, "cluster.placement=disaggregated", "cluster.rollout_gpus=4", "cluster.gpu_memory_gib=141")
    error = refused(*disaggregated, "rollout.server_args=[--disable-radix-cache, --enable-symm-mem]")
    assert ("rollout.server_args: (--enable-symm-mem) makes SGLang set NCCL_CUMEM_ENABLE=1 in its servers while the "
            "policy ranks run with 0, and the weight push's NCCL group between them fails; drop --enable-symm-mem, or "
            "export NCCL_CUMEM_ENABLE=1 where megarl launch runs (both sides then use 1)") in error  # fmt: skip
    plan(*disaggregated, "rollout.server_args=[--disable-radix-cache]")
    plan(GRPO72, "rollout.server_args=[--enable-symm-mem]")  # colocated: CUDA IPC, no NCCL group with SGLang
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the user's value on both sides: they agree
    plan(*disaggregated, "rollout.server_args=[--enable-symm-mem]")


def test_server_args_may_not_repeat_a_flag_megarl_sets_from_the_config():
    """A later --port or --load-format in the server's argv wins in SGLang's parser: the health
    probe would miss the server, or the engines would serve the checkpoint instead of pushes."""
    error = refused(GRPO72, "rollout.server_args=[--port=30000, --load-format, auto, --disable-radix-cache]")
    assert "rollout.server_args: (--port) is set by megarl from (a free port); drop it from rollout.server_args" in error
    assert "rollout.server_args: (--load-format) is set by megarl from (dummy when a push follows)" in error
    assert "--disable-radix-cache" not in error


def test_top_p_is_a_warning_not_a_refusal():
    p = plan(TINY, "rollout.sampling.top_p=0.9")
    assert any("off-policy" in str(w) for w in p.warnings)


def test_batch_arithmetic():
    assert "actor.mini_batch_size: (100) must divide the samples of a step" in refused(TINY, "actor.mini_batch_size=100")
    msg = refused(TINY, "actor.mini_batch_size=128", "actor.micro_batch_size=48")
    assert "must be divisible by dp x micro_batch_size = 2 x 48 = 96" in msg
    assert plan(TINY, "actor.mini_batch_size=128", "actor.micro_batch_size=32")
    assert "max_tokens_per_gpu: (8) must hold one full sequence" in refused(TINY, "actor.max_tokens_per_gpu=8")


def test_sft_is_planned_without_the_rl_checks():
    """`megarl sft` places the policy alone on every GPU; the rollout, critic, RL batch, sampling
    and algorithm settings of the same config are not its business, the policy's model-parallel
    rules and its micro-batches are."""
    rl_only = ("actor.mini_batch_size=100", "rollout.n=1", "data.max_prompt_length=61", "cluster.placement=disaggregated",
               "cluster.rollout_gpus=1", "rollout.tp=3")  # the torch engine cannot be disaggregated
    msg = refused(TINY, *rl_only)
    assert "actor.mini_batch_size" in msg and "rollout.n" in msg and "max_prompt_length" in msg
    assert "cluster.placement" in msg
    p = make_plan(load_config(TINY, list(rl_only)), sft=True)
    assert list(p.roles) == ["policy"] and (p.roles["policy"].tp, p.roles["policy"].dp) == (1, 2)  # every GPU
    assert p.memory is None
    with pytest.raises(PlanError, match=r"actor.parallel.tp: \(3\) must divide num_attention_heads"):
        make_plan(load_config(TINY, ["actor.parallel.tp=3"]), sft=True)
    with pytest.raises(PlanError, match="actor.micro_batch_size: set micro_batch_size or max_tokens_per_gpu"):
        make_plan(load_config(TINY, ["actor.micro_batch_size=null"]), sft=True)
    # sft.max_length (2048 by default) is capped by the tiny model's 64 positions
    with pytest.raises(PlanError, match=r"actor.max_tokens_per_gpu: \(63\) must hold one full row of 64 tokens"):
        make_plan(load_config(TINY, ["actor.max_tokens_per_gpu=63"]), sft=True)


def test_lengths_within_positions():
    assert ("(61 + 4 = 65) exceeds the model's max_position_embeddings (64); lower rollout.sampling.max_new_tokens "
            "to at most 3, or data.max_prompt_length") in refused(TINY, "data.max_prompt_length=61")
    assert "(64 + 4 = 68) exceeds the model's max_position_embeddings (64); lower data.max_prompt_length" in refused(
        TINY, "data.max_prompt_length=64")


def test_algorithm_needs():
    assert "rollout.n: (1) must be >= 2 for the group estimator grpo" in refused(TINY, "rollout.n=1", "actor.mini_batch_size=32")
    assert "critic.enabled: estimator gae needs a critic" in refused(TINY, "algorithm.estimator=gae", "critic.enabled=false")
    assert "reference.enabled: a KL term" in refused(TINY, "algorithm.kl.use_in_loss=true", "reference.enabled=false")
    assert plan(TINY, "algorithm.estimator=gae").roles["critic"].dp == 2


def test_critic_offload_decides_whether_the_critic_stays_while_the_policy_trains():
    """critic.offload takes the critic's params, grads and Adam state off the GPUs in every phase
    but its own (megarl/memory/residency.py): 8-GPU PPO at tp=2, micro 8 fits with it, not without."""
    micro8 = ("actor.micro_batch_size=8", "critic.micro_batch_size=8")
    msg = refused(PPO7, *micro8, "critic.offload=false")
    assert "actor: training needs an estimated 94.2 GiB per GPU in phase policy_update" in msg
    assert "actor.recompute=full" in msg and "set critic.offload=true" in msg
    assert "actor.optimizer.distributed=true" not in msg  # already set: not suggested
    mem = plan(PPO7, *micro8).memory
    critic = mem.critic.weights + mem.critic.grads + mem.critic.optimizer
    # + the trainer's runtime and colocated SGLang's CUDA context (its graphs are released outside generate)
    assert mem.phases["policy_update"] == pytest.approx(mem.policy.peak + 3 * GIB + 1.5 * GIB)
    kept = plan(PPO7, *micro8, "critic.offload=false", "cluster.gpu_memory_gib=141").memory  # H200s: it fits
    assert kept.phases["policy_update"] == pytest.approx(mem.phases["policy_update"] + critic)


def test_critic_offload_is_honoured_disaggregated_too():
    """Disaggregated, nothing makes room for the engines, but the critic still makes room for the policy's update."""
    pool = ("cluster.placement=disaggregated", "cluster.rollout_gpus=4")
    mem = plan(PPO7, *pool).memory
    assert mem.phases["policy_update"] == pytest.approx(mem.policy.peak + 3 * GIB)  # no critic, no engine: the trainer's runtime
    # The engines' own GPUs: mem_fraction of what SGLang sees free after its context (no trainer
    # there), plus its context and its CUDA graphs outside mem_fraction.
    assert mem.rollout.free_at_launch == pytest.approx(80 * GIB - 1.5 * GIB)
    assert mem.rollout_peak == pytest.approx(mem.rollout.budget + 4 * GIB)
    assert "set critic.offload=true" in refused(PPO7, *pool, "critic.offload=false")


def test_weights_cpu_backup_only_where_weights_are_released():
    assert "rollout.weights_cpu_backup: only colocated SGLang releases its weights" in refused(TINY, "rollout.weights_cpu_backup=true")
    assert plan(GRPO72, "rollout.weights_cpu_backup=true").memory.phases == plan(GRPO72).memory.phases  # same bytes on the GPUs


def test_a_gather_group_beyond_the_largest_tensor_is_counted_twice_in_the_push():
    embedding = 2 * 152064 * 8192  # the 72B model's largest tensor: the default group (one tensor)
    base = make_plan(load_config(GRPO72, [])).memory.phases["weight_push"]
    grouped = make_plan(load_config(GRPO72, ["rollout.weight_sync.gather_mb=4096"])).memory.phases["weight_push"]
    assert grouped - base == pytest.approx(2 * (4096 * 1024**2 - embedding))


def test_the_distributed_push_counts_its_flattened_copy_of_a_bucket():
    """The distributed transport sends each bucket as one flattened broadcast: the sender holds a
    copy of the bucket beside it (the disk transport writes the tensors as they are)."""
    disaggregated = ("cluster.nnodes=5", "cluster.placement=disaggregated", "cluster.rollout_gpus=8")
    push = {t: plan(GRPO72, *disaggregated, f"rollout.weight_sync.transport={t}").memory.phases["weight_push"]
            for t in ("distributed", "disk")}  # fmt: skip
    assert push["distributed"] - push["disk"] == pytest.approx(max(1024 * 1024**2, 2 * 152064 * 8192))


def test_a_push_over_budget_names_the_gather_group_only_when_it_is_what_grew():
    msg = refused(GRPO72, "rollout.weight_sync.gather_mb=40000")  # 2 x 39 GiB groups: the push phase is over
    assert "in phase weight_push" in msg and "lower rollout.weight_sync.bucket_mb, lower rollout.weight_sync.gather_mb" in msg
    msg = refused(GRPO72, "rollout.weight_sync.bucket_mb=40000")
    assert "in phase weight_push" in msg and "lower rollout.weight_sync.bucket_mb" in msg and "gather_mb" not in msg


def test_72b_phase_sums_are_the_printed_ones_by_hand_and_fit():
    """Each phase of the 72B colocated plan: the table's resident states summed by hand, equal
    to what `megarl plan` prints, within gpu_memory_gib."""
    cfg = load_config(GRPO72, [])
    p = make_plan(cfg)
    mem, pol, eng = p.memory, p.memory.policy, p.memory.rollout
    # Runtime in every phase: the trainer's (3 GiB) and SGLang's CUDA context and NCCL (1.5 GiB);
    # SGLang's CUDA graphs and allocator cache (2.5 GiB) while it holds them (launch, generate).
    # A push holds three buckets (the one sent, its flattened copy for CUDA IPC, the one
    # filled beside it), each up to bucket_mb (1024 MiB) or the embedding alone (the largest
    # tensor, 152064 x 8192 in bf16: 2.5 GB), and, while exporting, a TP gather group (one
    # tensor by default: the embedding) twice more: its gathered shards and the joined tensor.
    embedding = 2 * 152064 * 8192
    overhead, graphs, push = 4.5 * GIB, 2.5 * GIB, 3 * max(1024 * 1024**2, embedding) + 2 * embedding
    by_hand = {
        "start": pol.weights + pol.grads + pol.optimizer / 3 + pol.weights + overhead,  # + reference; no Adam moments yet
        "launch": eng.budget + graphs + overhead,
        "generate": eng.weights + eng.kv_cache + graphs + overhead,  # actor and reference offloaded
        "policy_forward": pol.weights + eng.weights + pol.logits + overhead,
        "reference_forward": pol.weights + eng.weights + pol.logits + overhead,  # the reference has the policy's shape
        "policy_update": pol.weights + pol.grads + pol.optimizer + pol.activations + pol.logits + pol.head_grad + overhead,
        "weight_push": pol.weights + eng.weights + push + overhead,
        "checkpoint": pol.weights + pol.optimizer + overhead,
    }
    assert mem.phases == pytest.approx(by_hand)
    assert max(mem.phases.values()) <= 80 * GIB
    line = next(x for x in _printed(cfg).splitlines() if x.startswith("by phase/GPU"))
    printed = dict(part.split() for part in line.removeprefix("by phase/GPU ").removesuffix(" GiB").split(", "))
    assert printed == {k: f"{v / GIB:.1f}" for k, v in by_hand.items()}


def test_72b_kv_cache_follows_from_what_sglang_sees_free_at_launch():
    """Colocated, SGLang sizes its KV cache from the memory free when it starts: 80 GiB less the
    trainer's runtime (3 GiB; its models are off the GPU at launch) and its own CUDA context and
    NCCL (1.5 GiB). mem_fraction 0.7 of 75.5 GiB, less 16.9 GiB of weights: 229 sequences of
    4096 tokens (160 MiB each), not the 250 of 0.7 x 80 GiB. The memory table names SGLang's
    memory outside mem_fraction on a line of its own."""
    cfg = load_config(GRPO72, [])
    eng = make_plan(cfg).memory.rollout
    seq = 2 * 80 * 1 * 128 * 2 * 4096  # K and V, 80 layers, one KV head per rank at tp 8, bf16, 4096 tokens
    assert eng.free_at_launch == 75.5 * GIB and eng.budget == pytest.approx(0.7 * 75.5 * GIB)
    assert eng.full_length_sequences == int((0.7 * 75.5 * GIB - eng.weights) // seq) == 229
    printed = _printed(cfg)
    assert ("rollout memory/GPU 52.8 GiB (mem_fraction 0.7 of the 75.5 GiB free at launch): weights 16.9 + KV cache 35.9 = "
            "229 sequences of full length at once") in printed
    assert ("runtime memory/GPU trainer 3.0 + SGLang outside mem_fraction 4.0 (CUDA context and NCCL 1.5, CUDA graphs and "
            "allocator cache 2.5) = 7.0 GiB (estimates, not measured)") in printed


def test_the_host_memory_of_a_node_is_each_ranks_copies_backups_and_save_gather_by_hand():
    # Colocated SGLang moves every trained model off the GPUs at each launch: each rank keeps a
    # host copy of its weights and optimizer state (gradients are freed), the reference's weights
    # too; SGLang's weight backup is the engine's weights per GPU; a fully_reshardable save gathers
    # each rank's stage of fp32 params and Adam moments (12 B a parameter: 6x the bf16 weights),
    # and stages what it writes in host memory: its weights and (dp 1) the stage's optimizer state.
    cfg = load_config(GRPO72, ["rollout.weights_cpu_backup=true", "actor.optimizer.checkpoint_format=fully_reshardable"])
    mem = make_plan(cfg).memory
    pol, eng, host = mem.policy, mem.rollout, mem.host
    assert host.offloaded == {"policy": pytest.approx(8 * (pol.weights + pol.optimizer)), "reference": pytest.approx(8 * pol.weights)}
    assert host.engine_backup == pytest.approx(8 * eng.weights)
    assert host.save_gather == {"policy": pytest.approx(8 * 6 * pol.weights)}
    assert host.save_staging == {"policy": pytest.approx(8 * (pol.weights + pol.optimizer))}
    save = 8 * (6 * pol.weights + pol.weights + pol.optimizer)
    assert host.peak == pytest.approx(8 * (pol.weights + pol.optimizer + pol.weights + eng.weights) + save)
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    assert (f"host memory/node (node 0) at least {g(host.peak)} GiB: offloaded copies {g(8 * (2 * pol.weights + pol.optimizer))} "
            f"(policy {g(8 * (pol.weights + pol.optimizer))}, reference {g(8 * pol.weights)}) + SGLang weight backup "
            f"{g(8 * eng.weights)} + checkpoint save {g(save)} (policy: staging {g(8 * (pol.weights + pol.optimizer))} + "
            f"fully_reshardable gather {g(48 * pol.weights)}) GiB") in _printed(cfg)
    msg = refused(GRPO72, "rollout.weights_cpu_backup=true", "actor.optimizer.checkpoint_format=fully_reshardable",
                  "cluster.host_memory_gib=256")
    assert (f"cluster.host_memory_gib: (256) is less than the {g(host.peak)} GiB of host memory node 0 needs at least (offloaded "
            "copies ") in msg
    assert ("GiB); set actor.optimizer.checkpoint_format=dp_reshardable, set rollout.weights_cpu_backup=false, raise "
            "actor.parallel.tp / pp, raise the node count") in msg
    assert plan(GRPO72, f"cluster.host_memory_gib={host.peak / GIB + 1}", "rollout.weights_cpu_backup=true",
                "actor.optimizer.checkpoint_format=fully_reshardable").memory.host.peak == host.peak  # fits: no refusal


def test_disaggregated_models_keep_host_copies_only_with_their_offload_flag():
    base = ("cluster.placement=disaggregated", "cluster.nnodes=2", "cluster.rollout_gpus=8", "actor.offload=false", "actor.recompute=full",
            "reference.offload=false", "critic.offload=false")  # (the shipped config offloads all three)
    kept = plan(PPO7, *base).memory
    assert kept.host.offloaded == {}  # nothing leaves the GPUs: no launch moves the models
    # A save still stages what each rank writes (tp 2, dp 4 on the 8 training GPUs): the first DP
    # rank of each TP pair writes the weights, every rank its dp_reshardable optimizer shard.
    pol = kept.policy
    assert kept.host.save_staging["policy"] == pytest.approx(2 * pol.weights + 8 * pol.optimizer)
    assert kept.host.peak == max(kept.host.save_staging.values())  # the roles save in turn
    mem = plan(PPO7, *base, "critic.offload=true").memory  # the critic leaves while the policy trains
    crit = mem.critic
    assert mem.host.node == 0 and mem.host.offloaded == {"critic": pytest.approx(8 * (crit.weights + crit.optimizer))}


def test_72b_host_memory_counts_the_checkpoint_staging():
    """megatron-core's torch_dist save copies every tensor a rank writes to host memory first
    (through torch's pinned host cache, released after the save): at 72B, tp 8, pp 4, dp 1 each
    rank stages its weights and its whole optimizer state, 30.6 GiB, 245 GiB per node while the
    policy saves, on top of the offload buffers (280 GiB)."""
    cfg = load_config(GRPO72, [])
    mem = make_plan(cfg).memory
    pol, host = mem.policy, mem.host
    staging = 8 * (pol.weights + pol.optimizer)
    assert host.save_staging == {"policy": pytest.approx(staging)} and host.save_gather == {}
    assert host.peak == pytest.approx(sum(host.offloaded.values()) + staging)
    assert f"{host.peak / GIB:.1f}" == "525.2" and f"{staging / GIB:.1f}" == "245.1"
    assert ("host memory/node (node 0) at least 525.2 GiB: offloaded copies 280.1 (policy 245.1, reference 35.0) + checkpoint "
            "staging 245.1 (policy, while it saves) GiB") in _printed(cfg)
    # dp 2 (8 nodes): each DP replica's first rank writes the weights, every rank its own optimizer shard.
    eight = make_plan(load_config(GRPO72, ["cluster.nnodes=8"]))
    big = eight.memory
    each = save_staging_host_bytes(cfg.actor, eight.roles["policy"], big.states, "policy")
    w, o = big.policy.weights, big.policy.optimizer
    assert each[:16] == [pytest.approx(w + o)] * 8 + [pytest.approx(o)] * 8  # ranks 0-7: dp 0, ranks 8-15: dp 1 (pp 0)
    assert big.host.save_staging == {"policy": pytest.approx(8 * (w + o))}  # node 0: the dp-0 ranks of stage 0


def test_temperature_and_warmup_and_adaptive_kl():
    assert "rollout.sampling.temperature: (0.0) must be > 0" in refused(TINY, "rollout.sampling.temperature=0")
    assert "trainer.critic_warmup_steps: (500) must be below trainer.total_steps (500)" in refused(
        TINY, "algorithm.estimator=gae", "trainer.critic_warmup_steps=500")
    assert "with use_in_reward=false it would be ignored" in refused(TINY, "algorithm.kl.controller=adaptive")
    # the adaptive rule multiplies the coefficient: from 0 it never moves, and no KL penalty is applied
    adaptive = ("algorithm.kl.controller=adaptive", "algorithm.kl.use_in_reward=true")
    assert ("algorithm.kl.coef: (0) is the adaptive controller's starting value, and its rule multiplies it: it would "
            "stay 0") in refused(TINY, *adaptive, "algorithm.kl.coef=0")
    assert plan(TINY, *adaptive, "algorithm.kl.coef=0.001")
    assert "algorithm.kl.reward_coef: (0) is the adaptive controller's starting value" in refused(
        TINY, *adaptive, "algorithm.kl.reward_coef=0")
    assert plan(TINY, *adaptive, "algorithm.kl.coef=0", "algorithm.kl.reward_coef=0.01")  # the loss's 0 is no matter
    ignored = [str(w) for w in plan(TINY, "algorithm.kl.use_in_loss=true", "algorithm.kl.reward_coef=0.1").warnings]
    assert ("algorithm.kl.reward_coef: (0.1) is ignored: there is no KL in the reward (algorithm.kl.use_in_reward=false); "
            "set use_in_reward=true or drop it") in ignored
    warned = plan(TINY, "algorithm.dynamic_sampling.enabled=true", "algorithm.estimator=reinforce_plus_plus")
    assert any("algorithm.dynamic_sampling" in str(w) for w in warned.warnings)


def test_logprob_micro_batches_size_the_forward_phases():
    base = plan(TINY, "actor.micro_batch_size=1").memory.phases
    more = plan(TINY, "actor.micro_batch_size=1", "actor.logprob_micro_batch_size=64").memory.phases
    assert more["policy_forward"] > base["policy_forward"] and more["policy_update"] == base["policy_update"]
    assert "actor.logprob_max_tokens_per_gpu: (8) must hold one full sequence" in refused(
        TINY, "actor.logprob_max_tokens_per_gpu=8")


def test_total_steps_beside_total_epochs_is_a_warning_naming_the_value_used():
    warned = [str(w) for w in plan(GRPO72, "trainer.total_steps=20").warnings]
    assert "trainer.total_epochs: (2) is ignored: trainer.total_steps (20) sets the run's length; drop one of them" in warned
    assert not any("total_epochs" in str(w) for w in plan(GRPO72).warnings)  # epochs alone: nothing to say


def test_memory_over_budget_names_knobs():
    msg = refused(GRPO72, "actor.optimizer.distributed=false", "actor.parallel.pp=1", "actor.parallel.tp=8",
                  "actor.recompute=none")
    assert "actor: training needs an estimated" in msg and "GiB over cluster.gpu_memory_gib (80)" in msg
    assert "actor.recompute=full" in msg
    assert "set actor.offload=true" in refused(GRPO72, "actor.offload=false")


def test_all_problems_reported_at_once():
    msg = refused(GRPO72, "actor.parallel.tp=3", "rollout.tp=16", "trainer.total_epochs=null")
    assert msg.count("\n  - ") >= 3


def test_check_files_for_launch(tmp_path):
    msg = str(pytest.raises(PlanError, make_plan, load_config(TINY, [f"data.train_files=[{tmp_path}/x.parquet]"]), check_files=True).value)
    assert f"data.train_files[0] (x.parquet): file {tmp_path}/x.parquet does not exist" in msg


def test_a_server_python_without_sglang_is_refused_before_launch(tmp_path):
    sglang = ["rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3", "cluster.rollout_gpus=1"]

    def refusal(python: str) -> str:
        cfg = load_config(TINY, [*sglang, f"rollout.server_python={python}"])
        with pytest.raises(PlanError) as info:
            make_plan(cfg, check_files=True)
        return str(info.value)

    assert f"rollout.server_python: ({sys.executable}) cannot import sglang; point it at" in refusal(sys.executable)
    assert "is not an executable Python interpreter" in refusal(str(tmp_path / "python"))
    fake = tmp_path / "venv"  # an interpreter that has sglang: a package of that name on its path
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    python = tmp_path / "python-with-sglang"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    issues: list = []
    check_server_python(load_config(TINY, [*sglang, f"rollout.server_python={python}"]), issues)
    assert issues == []


def test_in_process_runs_need_a_world_of_one_and_the_torch_engine(monkeypatch):
    from megarl.config.loading import load_config
    from megarl.plan.planner import PlanError, make_plan

    def refused_in_process(*overrides: str) -> str:
        with pytest.raises(PlanError) as err:
            make_plan(load_config(TINY, list(overrides)), in_process=True)
        return str(err.value)

    assert "--in-process runs a world of one process, the config has 2" in refused_in_process()
    make_plan(load_config(TINY, ["cluster.gpus_per_node=1"]), in_process=True)
    assert "needs Ray to place its servers" in refused_in_process(
        "cluster.gpus_per_node=1", "rollout.engine=sglang", "cluster.device=cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "WORLD_SIZE is 2" in refused_in_process("cluster.gpus_per_node=1")


def test_sglang_deterministic_inference_is_refused_on_cpu():
    """A real SGLang 0.5.23 CPU server exits at start with --enable-deterministic-inference
    (no deterministic attention backend on CPU); on GPUs it is allowed."""
    sglang_cpu = ("rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.rollout_gpus=1")
    assert re.search(r"rollout.deterministic: \(true\) needs SGLang's deterministic GPU attention kernels.*"
                     r"set rollout.deterministic=false", refused(TINY, *sglang_cpu, "rollout.deterministic=true"))
    assert plan(TINY, *sglang_cpu).memory is not None
    assert plan(TINY, "rollout.deterministic=true").memory is not None  # the torch engine: seeded anyway
    assert plan(GRPO72, "rollout.deterministic=true").memory is not None


def test_agent_rollouts_need_the_chat_template_and_no_overlap_when_deterministic():
    msg = refused(AGENT, "rollout.deterministic=true", "rollout.agent.overlap_tools=true", "data.apply_chat_template=false")
    assert "rollout.agent.overlap_tools: (true) lets tool timing decide which turns generate together" in msg
    assert "data.apply_chat_template: (false) but rollout.agent appends tool answers and user turns" in msg
    assert plan(AGENT, "rollout.deterministic=true").memory is not None  # overlap left unset: rounds, reproducible


def test_recompute_auto_is_the_least_that_fits_and_reaches_the_run():
    from megarl.plan.planner import resolved_config

    rows = "actor.max_tokens_per_gpu=null"  # micro-batches of micro_batch_size rows (1), not the config's 16k tokens
    fits = plan(GRPO72, "actor.recompute=auto", rows)  # micro-batch 1: fits without recompute
    assert fits.resolved == {"actor.recompute": "none"}
    assert fits.memory.policy == plan(GRPO72, "actor.recompute=none", rows).memory.policy
    big = ("actor.recompute=auto", rows, "actor.micro_batch_size=4")  # 86 GiB without recompute
    assert "actor: training needs an estimated" in refused(GRPO72, "actor.recompute=none", *big[1:])
    cfg = load_config(GRPO72, list(big))
    chosen = make_plan(cfg)
    assert chosen.resolved == {"actor.recompute": "full"}
    assert chosen.memory.policy == plan(GRPO72, "actor.recompute=full", *big[1:]).memory.policy
    assert "dp1 sp recompute full (auto)" in _printed(cfg)
    # What the workers are built from (build_trainer and megarl sft apply it).
    assert resolved_config(cfg, chosen.resolved).actor.recompute == "full" and cfg.actor.recompute == "auto"
    # No memory check on CPU or in megarl sft: none.
    assert plan(TINY, "actor.recompute=auto").resolved == {"actor.recompute": "none"}
    assert make_plan(load_config(TINY, ["actor.recompute=auto"]), sft=True).resolved == {"actor.recompute": "none"}
    assert plan(GRPO72).resolved == {}  # an explicit choice is kept as is
    # Refused even with full: the fix does not offer what auto already tried.
    msg = refused(GRPO72, "actor.recompute=auto", rows, "actor.micro_batch_size=64")
    assert "actor: training needs" in msg and "recompute=full" not in msg


def test_several_greedy_validation_samples_are_a_warning():
    warned = " ".join(map(str, plan(TINY, "rollout.val.n=4").warnings))
    assert "rollout.val.n: (4): 4 greedy responses of one prompt are all the same one, so pass@k" in warned
    assert plan(TINY, "rollout.val.n=4", "rollout.val.greedy=false").warnings == []
    assert plan(TINY, "rollout.val.n=1").warnings == []
    assert not [w for w in plan(TINY, "rollout.val.n=4", "data.val_files=[]").warnings if w.field == "rollout.val.n"]


def test_a_validation_pass_threshold_the_reward_cannot_meet_is_refused():
    with pytest.raises(PlanError, match=r"rollout.val.pass_threshold: \(2\) must be in \(0, 1\]: the built-in reward "
                                        r"functions score from 0 to 1, so no response could pass"):  # fmt: skip
        make_plan(load_config(TINY, ["rollout.val.pass_threshold=2"]))
    custom = ["reward.custom.path=mine.py", "reward.custom.name=score"]  # a custom function's scores have no fixed range
    assert make_plan(load_config(TINY, ["rollout.val.pass_threshold=2", *custom]))


def test_sglang_server_keys_with_the_torch_engine_are_a_warning():
    warned = " ".join(map(str, plan(TINY, "rollout.engine_kwargs={chunked_prefill_size: 512}", "rollout.server_args=[--log-level=debug]").warnings))
    assert "rollout.engine_kwargs: is set, and it is SGLang's: rollout.engine=torch ignores it" in warned
    assert "rollout.server_args: is set, and it is SGLang's" in warned
    assert not [w for w in plan(GRPO72, "rollout.engine_kwargs={chunked_prefill_size: 512}").warnings  # its engine: SGLang
                if w.field.startswith("rollout.engine_kwargs")]
