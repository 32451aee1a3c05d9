"""Each planner check: a good config passes, a bad one fails naming the field and a fix."""

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.config.planner import PlanError, make_plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
GRPO72 = CONFIGS / "qwen72b_grpo.yaml"
PPO7 = CONFIGS / "qwen2.5_7b_ppo.yaml"
TINY = CONFIGS / "tiny_grpo.yaml"


def plan(path, *overrides):
    return make_plan(load_config(path, list(overrides)))


def refused(path, *overrides) -> str:
    with pytest.raises(PlanError) as info:
        plan(path, *overrides)
    return str(info.value)


@pytest.mark.parametrize("path", [GRPO72, PPO7, TINY], ids=lambda p: p.name)
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
    assert "actor.parallel.tp: (3) must divide num_attention_heads (64)" in msg and "try 1, 2, 4 or 8" in msg


def test_tp_must_divide_query_groups():
    msg = refused(PPO7, "actor.parallel.tp=7", "cluster.gpus_per_node=7")  # 28 heads, 4 kv heads
    assert "num_key_value_heads (4)" in msg


def test_pp_must_divide_layers():
    assert "actor.parallel.pp: (3) must divide num_layers (80)" in refused(GRPO72, "actor.parallel.pp=3")


def test_world_must_be_a_multiple_of_tp_pp():
    assert "tp x pp (8 x 4 = 32) must divide the 24 GPUs" in refused(GRPO72, "cluster.nnodes=3")


def test_sequence_parallel_not_supported_yet():
    assert "sequence_parallel: is not supported yet" in refused(GRPO72, "actor.parallel.sequence_parallel=true")


@pytest.mark.parametrize("knob", ["vpp", "cp", "ep"])
def test_out_of_scope_parallelism_is_refused(knob):
    assert f"actor.parallel.{knob}" in refused(GRPO72, f"actor.parallel.{knob}=2")
    assert "not supported yet" in refused(GRPO72, f"actor.parallel.{knob}=2")


def test_moe_model_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_experts": 8}'
    )
    assert "mixture-of-experts" in refused(TINY, f"model.path={tmp_path}")


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
    assert "sglang needs cluster.device=cuda" in refused(TINY, "rollout.engine=sglang")


def test_top_p_is_a_warning_not_a_refusal():
    p = plan(TINY, "rollout.sampling.top_p=0.9")
    assert any("off-policy" in str(w) for w in p.warnings)


def test_batch_arithmetic():
    assert "actor.mini_batch_size: (100) must divide the samples of a step" in refused(TINY, "actor.mini_batch_size=100")
    msg = refused(TINY, "actor.mini_batch_size=128", "actor.micro_batch_size=48")
    assert "must be divisible by dp x micro_batch_size = 2 x 48 = 96" in msg
    assert plan(TINY, "actor.mini_batch_size=128", "actor.micro_batch_size=32")
    assert "max_tokens_per_gpu: (8) must hold one full sequence" in refused(TINY, "actor.max_tokens_per_gpu=8")


def test_lengths_within_positions():
    assert "exceeds the model's max_position_embeddings (64)" in refused(TINY, "data.max_prompt_length=61")


def test_algorithm_needs():
    assert "rollout.n: (1) must be >= 2 for the group estimator grpo" in refused(TINY, "rollout.n=1", "actor.mini_batch_size=32")
    assert "critic.enabled: estimator gae needs a critic" in refused(TINY, "algorithm.estimator=gae", "critic.enabled=false")
    assert "reference.enabled: a KL term" in refused(TINY, "algorithm.kl.use_in_loss=true", "reference.enabled=false")
    assert plan(TINY, "algorithm.estimator=gae").roles["critic"].dp == 2


def test_training_counts_the_other_models_states():
    """The critic's params, grads and Adam state stay on the GPU while the policy trains
    (offload only applies around generation): 2 x 8-GPU PPO at tp=2, micro 4 does not fit."""
    msg = refused(PPO7, "actor.micro_batch_size=4", "critic.micro_batch_size=4")
    assert "actor: training needs an estimated" in msg and "actor.recompute=full" in msg
    assert "actor.optimizer.distributed=true" not in msg  # already set: not suggested


def test_temperature_and_warmup_and_adaptive_kl():
    assert "rollout.sampling.temperature: (0.0) must be > 0" in refused(TINY, "rollout.sampling.temperature=0")
    assert "trainer.critic_warmup_steps: (500) must be below trainer.total_steps (500)" in refused(
        TINY, "algorithm.estimator=gae", "trainer.critic_warmup_steps=500")
    assert "with use_in_reward=false it would be ignored" in refused(TINY, "algorithm.kl.controller=adaptive")
    warned = plan(TINY, "algorithm.dynamic_sampling.enabled=true", "algorithm.estimator=reinforce_plus_plus")
    assert any("algorithm.dynamic_sampling" in str(w) for w in warned.warnings)


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
    assert f"data.train_files[0]: {tmp_path}/x.parquet does not exist" in msg
