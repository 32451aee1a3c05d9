"""`megarl config --from-verl`: verl runs written here in verl's documented forms (examples/*.sh
scripts, recipe scripts, Hydra YAML) become megarl configs key by key, the table accounts for
every key given, and the result passes `megarl plan`."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from megarl.cli import main
from megarl.commands.from_verl import from_verl
from megarl.config.loading import ConfigError, load_config, validate_config
from megarl.config.verl_keys import RULES, is_verl_key
from megarl.config.verl_script import parse_hydra, read_verl
from megarl.config.verl_translate import Translation, translate

# verl's examples/grpo_trainer/run_qwen2-7b.sh as its docs show it (GRPO on gsm8k).
GRPO_GSM8K = r"""set -x

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _translate(tmp_path: Path, name: str, text: str, *overrides: str, env: dict[str, str] | None = None) -> Translation:
    return translate(read_verl(_write(tmp_path, name, text), list(overrides), env={"HOME": "/home/u"} if env is None else env))


def _row(t: Translation, verl_text: str) -> str:
    """The outcome of the row whose verl key is ``verl_text``: its megarl keys, or its reason."""
    rows = [r for r in t.given + t.defaults + t.choices if r.verl == verl_text]
    assert len(rows) == 1, [r.verl for r in t.given + t.defaults]
    row = rows[0]
    return ", ".join(f"{k}={v}" for k, v in row.sets.items()) if row.sets else f"{row.group}: {row.note}"


def test_grpo_gsm8k_script_key_by_key(tmp_path: Path):
    t = _translate(tmp_path, "run_qwen2-7b.sh", GRPO_GSM8K)
    v = t.values
    assert v["algorithm.estimator"] == "grpo"
    assert v["data.train_files"] == ["/home/u/data/gsm8k/train.parquet"]  # $HOME from the environment
    assert v["data.val_files"] == ["/home/u/data/gsm8k/test.parquet"]
    assert v["data.prompts_per_step"] == 1024  # prompts per step in both
    assert v["data.max_prompt_length"] == 512
    assert v["rollout.sampling.max_new_tokens"] == 1024
    assert v["data.filter_overlong_prompts"] is True and v["data.truncation"] == "error"
    assert (v["model.path"], v["model.arch"]) == ("Qwen/Qwen2-7B-Instruct", "qwen2-7b")
    assert v["actor.optimizer.lr"] == 1e-6 and isinstance(v["actor.optimizer.lr"], float)
    assert v["actor.mini_batch_size"] == 256 * 5  # prompts x n
    assert v["actor.micro_batch_size"] == 40
    assert (v["algorithm.kl.use_in_loss"], v["algorithm.kl.loss_coef"], v["algorithm.kl.loss_estimator"]) == (True, 0.001, "k3")
    assert "algorithm.kl.coef" not in v and "algorithm.kl.estimator" not in v  # the shared settings stay megarl's
    assert v["algorithm.kl.use_in_reward"] is False
    assert v["actor.recompute"] == "full" and v["actor.pack_sequences"] is True
    assert v["actor.offload"] is False and v["reference.offload"] is True
    assert (v["rollout.engine"], v["rollout.tp"], v["rollout.mem_fraction"], v["rollout.n"]) == ("sglang", 2, 0.6, 5)
    assert v["trainer.loggers"] == ["console", "wandb"]
    assert (v["trainer.project"], v["trainer.experiment"]) == ("verl_grpo_example_gsm8k", "qwen2_7b_function_rm")
    assert (v["cluster.gpus_per_node"], v["cluster.nnodes"]) == (8, 1)
    assert (v["trainer.save_freq"], v["trainer.eval_freq"], v["trainer.total_epochs"]) == (20, 5, 15)
    # verl's defaults the run relies on
    assert v["actor.optimizer.weight_decay"] == 0.01
    assert v["trainer.eval_before_train"] is True
    assert v["trainer.output_dir"] == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"
    assert "critic.optimizer.lr" not in v  # GRPO: no critic, none of its defaults
    assert _row(t, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40") == "actor.logprob_micro_batch_size=40"
    assert _row(t, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40") == "actor.logprob_micro_batch_size=40"
    assert v["actor.logprob_micro_batch_size"] == 40
    assert _row(t, "actor_rollout_ref.rollout.name=vllm") == "rollout.engine=sglang"


def test_grpo_gsm8k_command_writes_what_plan_accepts_and_a_table_of_every_key(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal (or a pipe) wraps nothing
    script = _write(tmp_path, "run_qwen2-7b.sh", GRPO_GSM8K)
    out = tmp_path / "megarl.yaml"
    assert main(["config", "--from-verl", str(script), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    words = re.findall(r"^\s+(\S+=.*?) \\?$", GRPO_GSM8K, flags=re.M)
    words[-1] = words[-1].removesuffix(" $@")
    assert len(words) == 36
    lines = printed.splitlines()
    for word in words:  # one line per key, in full as given
        assert sum(line.split() [:1] == [word] for line in lines) == 1, word
    assert "(FSDP: no model-parallel layout given)" in printed  # megarl's choice of layout, shown
    cfg = load_config(out)
    assert cfg.actor.parallel.tp >= 1 and cfg.rollout.n == 5 and cfg.actor.mini_batch_size == 1280
    capsys.readouterr()
    assert main(["plan", str(out)]) == 0


def test_ppo_with_critic_takes_verls_defaults(tmp_path: Path):
    """No adv_estimator: GAE with a critic; the critic's placeholder path is the actor's model."""
    t = _translate(tmp_path, "ppo.sh", r"""
        export VLLM_ATTENTION_BACKEND=XFORMERS
        MODEL=Qwen/Qwen2.5-3B-Instruct
        python3 -m verl.trainer.main_ppo \
            data.train_files="['/d/gsm8k/train.parquet', '/d/math/train.parquet']" \
            data.train_batch_size=256 \
            actor_rollout_ref.model.path=$MODEL \
            actor_rollout_ref.actor.ppo_mini_batch_size=64 \
            actor_rollout_ref.actor.ppo_micro_batch_size=64 \
            actor_rollout_ref.rollout.name=sglang \
            critic.optim.lr=2e-5 \
            critic.model.enable_gradient_checkpointing=False \
            critic.ppo_micro_batch_size_per_gpu=4 \
            algorithm.use_kl_in_reward=True \
            algorithm.kl_ctrl.kl_coef=0.002 \
            trainer.critic_warmup=3 \
            trainer.n_gpus_per_node=4
        """)  # fmt: skip
    v = t.values
    assert v["data.train_files"] == ["/d/gsm8k/train.parquet", "/d/math/train.parquet"]
    assert v["algorithm.estimator"] == "gae"  # verl's default
    assert (v["model.path"], v["model.arch"]) == ("Qwen/Qwen2.5-3B-Instruct", "qwen2.5-3b")
    assert v["rollout.n"] == 1  # verl's default, not megarl's 8
    assert v["actor.mini_batch_size"] == 64
    assert v["actor.micro_batch_size"] == 16  # verl's global micro-batch over 4 GPUs
    assert v["critic.optimizer.lr"] == 2e-5
    assert v["critic.recompute"] == "none"
    assert v["critic.micro_batch_size"] == 4
    assert v["critic.mini_batch_size"] == 64  # the actor's, verl's interpolation
    assert v["algorithm.clip.value"] == 0.5  # verl's cliprange_value default
    assert v["critic.optimizer.weight_decay"] == 0.01
    assert (v["algorithm.kl.use_in_reward"], v["algorithm.kl.reward_coef"], v["algorithm.kl.reward_estimator"]) == (True, 0.002, "k1")
    assert v["trainer.critic_warmup_steps"] == 2  # verl's N trains the actor from step N
    assert "critic.path" not in v
    assert "actor's model" in _row(t, f"critic.model.path: {'~/models/deepseek-llm-7b-chat'}")
    assert _row(t, "algorithm.adv_estimator: gae") == "algorithm.estimator=gae"
    assert (v["data.max_prompt_length"], v["rollout.sampling.max_new_tokens"], v["data.prompts_per_step"]) == (512, 512, 256)


def test_dapo_recipe_script(tmp_path: Path):
    """A recipe script: variables with defaults, a ray job submit line, + keys, overlong and filter groups."""
    t = _translate(tmp_path, "test_dapo_7b.sh", r"""
        #!/usr/bin/env bash
        set -euxo pipefail
        project_name='DAPO'
        exp_name='DAPO-Qwen2.5-7B'
        clip_ratio_low=0.2
        clip_ratio_high=0.28
        max_response_length=$((1024 * 2))
        enable_overlong_buffer=True
        overlong_buffer_len=512
        overlong_penalty_factor=1.0
        n_resp_per_prompt=16
        MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-7B"}
        NNODES=${NNODES:-1}
        ray job submit --runtime-env="${RUNTIME_ENV}" -- python3 -m recipe.dapo.main_dapo \
            data.train_files="/data/dapo-math-17k.parquet" \
            data.prompt_key=prompt \
            data.truncation='left' \
            data.max_response_length=2048 \
            data.gen_batch_size=1536 \
            data.train_batch_size=512 \
            actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
            algorithm.adv_estimator=grpo \
            actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \
            actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \
            actor_rollout_ref.actor.clip_ratio_c=10.0 \
            actor_rollout_ref.actor.loss_agg_mode=token-mean \
            algorithm.filter_groups.enable=True \
            algorithm.filter_groups.metric=acc \
            algorithm.filter_groups.max_num_gen_batches=10 \
            actor_rollout_ref.model.path="${MODEL_PATH}" \
            actor_rollout_ref.actor.ppo_mini_batch_size=32 \
            actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
            actor_rollout_ref.actor.optim.weight_decay=0.1 \
            actor_rollout_ref.rollout.temperature=1.0 \
            actor_rollout_ref.rollout.val_kwargs.do_sample=True \
            actor_rollout_ref.rollout.val_kwargs.n=1 \
            reward_model.reward_manager=dapo \
            +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${enable_overlong_buffer} \
            +reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
            +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=${overlong_penalty_factor} \
            trainer.project_name="${project_name}" \
            trainer.experiment_name="${exp_name}" \
            trainer.nnodes="${NNODES}" \
            trainer.total_training_steps=100
        """, env={"RAY_DATA_HOME": "/ray"})  # fmt: skip
    v = t.values
    assert v["model.path"] == "/ray/models/Qwen2.5-7B" and v["model.arch"] == "qwen2.5-7b"
    assert (v["algorithm.clip.low"], v["algorithm.clip.high"], v["algorithm.clip.dual_c"]) == (0.2, 0.28, 10.0)
    assert v["algorithm.dynamic_sampling.enabled"] is True and v["algorithm.dynamic_sampling.max_rounds"] == 10
    assert (v["algorithm.overlong.length"], v["algorithm.overlong.penalty"]) == (512, 1.0)
    assert v["rollout.n"] == 16 and v["actor.mini_batch_size"] == 32 * 16
    assert v["data.truncation"] == "left" and v["rollout.sampling.max_new_tokens"] == 2048
    assert v["actor.optimizer.warmup_steps"] == 10 * (512 // 32)  # RL steps -> optimizer steps
    assert v["rollout.val.greedy"] is False and v["rollout.val.n"] == 1
    assert v["trainer.total_steps"] == 100 and "trainer.total_epochs" not in v
    assert (v["trainer.project"], v["trainer.experiment"], v["cluster.nnodes"]) == ("DAPO", "DAPO-Qwen2.5-7B", 1)
    assert _row(t, "data.gen_batch_size=1536").startswith("no equivalent")
    assert "overlong" in _row(t, "reward_model.reward_manager=dapo")
    assert _row(t, "+reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len}") == "algorithm.overlong.length=512"
    assert any("$((1024 * 2))" in n or "RUNTIME_ENV" in n for n in t.notes)  # what could not be read is said


def test_multi_turn_with_tools(tmp_path: Path):
    t = _translate(tmp_path, "run_gsm8k_multiturn.sh", r"""
        PROJECT_DIR="$(pwd)"
        CONFIG_PATH="$PROJECT_DIR/examples/sglang_multiturn/config"
        python3 -m verl.trainer.main_ppo \
            --config-path="$CONFIG_PATH" \
            --config-name='gsm8k_multiturn_grpo' \
            algorithm.adv_estimator=grpo \
            data.return_raw_chat=True \
            actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
            actor_rollout_ref.rollout.name=sglang \
            actor_rollout_ref.rollout.multi_turn.enable=True \
            actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \
            actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2 \
            actor_rollout_ref.rollout.multi_turn.format=hermes \
            actor_rollout_ref.rollout.multi_turn.tool_config_path=/cfg/tool_config/gsm8k_tool_config.yaml \
            actor_rollout_ref.rollout.multi_turn.interaction_config_path=/cfg/interaction.yaml \
            actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
            actor_rollout_ref.rollout.n=16 "$@"
        """)  # fmt: skip
    v = t.values
    assert v["rollout.agent.max_turns"] == 5 and v["rollout.agent.max_parallel_calls"] == 2
    assert v["rollout.agent.tool_parser"] == "hermes"
    assert v["rollout.agent.tools_file"] == "/cfg/tool_config/gsm8k_tool_config.yaml"
    assert v["rollout.agent.interactions_file"] == "/cfg/interaction.yaml"
    assert v["rollout.agent.default_agent"] == "tool_agent"
    assert _row(t, "actor_rollout_ref.rollout.multi_turn.enable=True").startswith("no equivalent: megarl picks")
    assert _row(t, "data.return_raw_chat=True").startswith("no equivalent")
    assert not t.megatron


def test_megatron_backend_moe_and_lora(tmp_path: Path):
    t = _translate(tmp_path, "run_qwen3moe_megatron.sh", r"""
        python3 -m verl.trainer.main_ppo --config-path=config \
            --config-name='ppo_megatron_trainer.yaml' \
            algorithm.adv_estimator=grpo \
            actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B \
            actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \
            actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \
            actor_rollout_ref.actor.megatron.expert_model_parallel_size=4 \
            actor_rollout_ref.actor.megatron.sequence_parallel=True \
            actor_rollout_ref.actor.megatron.param_offload=True \
            actor_rollout_ref.actor.megatron.use_dist_checkpointing=True \
            actor_rollout_ref.actor.optim.clip_grad=0.5 \
            actor_rollout_ref.actor.optim.lr_decay_style=cosine \
            actor_rollout_ref.actor.optim.min_lr=1e-7 \
            actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective \
            actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4 \
            actor_rollout_ref.ref.megatron.param_offload=True \
            actor_rollout_ref.model.lora_rank=32 \
            actor_rollout_ref.model.lora_alpha=64 \
            actor_rollout_ref.model.target_modules='[q_proj,v_proj]' \
            actor_rollout_ref.rollout.n=8 \
            trainer.n_gpus_per_node=8 trainer.nnodes=2
        """)  # fmt: skip
    v = t.values
    assert t.megatron
    assert (v["actor.parallel.tp"], v["actor.parallel.pp"], v["actor.parallel.ep"]) == (4, 2, 4)
    assert v["actor.parallel.sequence_parallel"] is None  # verl's true: on when tp > 1
    assert v["actor.offload"] is True and v["reference.offload"] is True
    assert (v["actor.optimizer.clip_grad"], v["actor.optimizer.schedule"], v["actor.optimizer.min_lr"]) == (0.5, "cosine", 1e-7)
    assert v["actor.recompute"] == "selective"
    assert (v["actor.lora.rank"], v["actor.lora.alpha"], v["actor.lora.target_modules"]) == (32, 64.0, ["q_proj", "v_proj"])
    assert v["model.arch"] == "qwen3-30b-a3b"
    assert "reference takes the policy's layout" in _row(t, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4")
    assert _row(t, "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True").startswith("no equivalent")
    assert not t.choices  # a Megatron run keeps its own layout


def test_yaml_config_and_overrides_after_it(tmp_path: Path):
    path = _write(tmp_path, "ppo.yaml", """
        defaults:
          - ppo_megatron_trainer
          - _self_
        data:
          train_files: /d/train.parquet
          train_batch_size: 64
        actor_rollout_ref:
          model: {path: /models/Qwen3-8B}
          actor:
            ppo_mini_batch_size: 16
            fsdp_config: {param_offload: true}
          rollout: {name: sglang, n: 4}
        algorithm: {adv_estimator: rloo}
        """)  # fmt: skip
    t = translate(read_verl(path, ["data.train_batch_size=128", "+trainer.val_before_train=False"], env={}))
    v = t.values
    assert t.megatron and v["model.arch"] == "qwen3-8b" and v["model.path"] == "/models/Qwen3-8B"
    assert v["data.prompts_per_step"] == 128  # the override wins
    assert _row(t, "data.train_batch_size: 64").startswith(": given again later")
    assert v["actor.mini_batch_size"] == 64 and v["algorithm.estimator"] == "rloo"
    assert "trainer.eval_before_train" not in v or v["trainer.eval_before_train"] is False


def test_script_reading_details(tmp_path: Path):
    """Comments, exports, other commands, unset variables, command substitution, $@ and ~deletes."""
    path = _write(tmp_path, "run.sh", r"""
        set -x
        export CUDA_DEVICE_MAX_CONNECTIONS=1  # a comment
        pip install -e . && echo ready
        gsm8k_train=/d/gsm8k/train.parquet
        train_files="['$gsm8k_train', '/d/math/train.parquet']"
        python3 -m verl.trainer.main_ppo \
            data.train_files="$train_files" \
            data.val_files=$VAL_FILES \
            'trainer.logger=[console]' \
            ~trainer.default_hdfs_dir \
            trainer.n_gpus_per_node=$(nvidia-smi -L | wc -l) $@
        """)  # fmt: skip
    run = read_verl(path, env={})
    given = {g.key: g.value for g in run.given}
    assert given["data.train_files"] == ["/d/gsm8k/train.parquet", "/d/math/train.parquet"]
    assert given["data.val_files"] == "$VAL_FILES"
    assert given["trainer.logger"] == ["console"]
    assert any("$VAL_FILES" in n for n in run.notes) and any("nvidia-smi" in n for n in run.notes)
    assert [g.deleted for g in run.given if g.key == "trainer.default_hdfs_dir"] == [True]


def test_hydra_values():
    assert parse_hydra("1e-6") == 1e-6 and parse_hydra("True") is True and parse_hydra("null") is None
    assert parse_hydra("['a.parquet', 'b.parquet']") == ["a.parquet", "b.parquet"]
    assert parse_hydra("[console,wandb]") == ["console", "wandb"] and parse_hydra("256") == 256


def test_unreadable_runs_are_one_line_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="no `python3 -m verl.trainer.main_ppo`"):
        read_verl(_write(tmp_path, "a.sh", "echo hello\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_verl(tmp_path / "missing.sh")
    with pytest.raises(ConfigError, match=r"not a verl override key=value"):
        read_verl(_write(tmp_path, "b.sh", "python3 -m verl.trainer.main_ppo data.train_files\n"))


@pytest.mark.parametrize("override, megarl", [
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr is verl's name; megarl's is actor.optimizer.lr"),
    ("data.train_batch_size=256", "data.train_batch_size is verl's name; megarl's is data.prompts_per_step"),
    ("actor_rollout_ref.rollout.enforce_eager=True", "megarl has no equivalent (vLLM-only"),
])  # fmt: skip
def test_a_verl_key_given_to_megarl_is_refused_with_megarls_name(override: str, megarl: str, capsys):
    root = Path(__file__).resolve().parents[3]
    for command in (["plan", str(root / "configs/tiny_grpo.yaml")], ["launch", str(root / "configs/tiny_grpo.yaml")]):
        assert main([*command, override]) == 2
        err = capsys.readouterr().err.strip()
        assert megarl in err and len(err.splitlines()) == 1


def test_a_misspelt_megarl_key_is_not_taken_for_verls():
    with pytest.raises(ConfigError, match="did you mean trainer.total_steps"):
        load_config(None, ["model.arch=tiny-demo", "trainer.totl_steps=3"])


def test_every_rule_names_real_megarl_keys():
    from megarl.config.documentation import describe

    for rule in RULES:
        for key in rule.megarl:
            describe(key.removesuffix(".*"))  # raises for a key megarl lacks
        assert rule.megarl or rule.reason, rule.verl
    assert is_verl_key("actor_rollout_ref") and not is_verl_key("model")


def test_written_config_is_plain_yaml(tmp_path: Path, capsys):
    script = _write(tmp_path, "run.sh", GRPO_GSM8K)
    out = tmp_path / "m.yaml"
    assert main(["config", "--from-verl", str(script), "trainer.nnodes=2", "--out", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    assert list(data)[:2] == ["model", "cluster"] and data["cluster"]["nnodes"] == 2
    capsys.readouterr()
    # 4 GPUs are too few for Qwen2-7B without offload: the config is written, the plan's refusal said
    assert main(["config", "--from-verl", str(script), "trainer.n_gpus_per_node=4", "--out", str(out)]) == 2
    assert "megarl plan refuses it" in capsys.readouterr().err
    assert yaml.safe_load(out.read_text())["cluster"]["gpus_per_node"] == 4
    assert main(["config", "--from-verl", str(script)]) == 2
    assert "needs --out FILE" in capsys.readouterr().err


def test_a_dump_of_verls_config_nulls_interpolations_and_megatron_lora(tmp_path: Path):
    """A saved verl config holds nulls, ${oc.select:...} and relative ${.key} interpolations, and
    the Megatron LoRA group with Megatron's module names."""
    path = _write(tmp_path, "dump.yaml", """
        actor_rollout_ref:
          model:
            path: /m/Qwen3-8B
            lora: {rank: 16, alpha: 32, target_modules: [linear_qkv, linear_proj], type: lora}
          actor:
            ppo_mini_batch_size: 8
            ppo_micro_batch_size: null
            use_remove_padding: ${oc.select:actor_rollout_ref.model.use_remove_padding,false}
            router_replay: {mode: R3, record_file: null}
            megatron: {virtual_pipeline_model_parallel_size: null, tensor_model_parallel_size: 2}
          rollout: {name: sglang, n: 4}
        critic:
          ppo_micro_batch_size: null
          ppo_micro_batch_size_per_gpu: ${oc.select:.ppo_micro_batch_size,null}
        transfer_queue: {enable: false}
        """)  # fmt: skip
    t = translate(read_verl(path, env={}))
    v = t.values
    assert (v["actor.lora.rank"], v["actor.lora.alpha"]) == (16, 32.0)
    assert v["actor.lora.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert v["actor.pack_sequences"] is False and v["actor.moe.routing_replay"] == "experts"
    assert (v["actor.parallel.vpp"], v["actor.parallel.tp"]) == (1, 2)
    assert "actor.micro_batch_size" not in v and "critic.micro_batch_size" not in v  # nulls: megarl's defaults
    assert _row(t, "actor_rollout_ref.actor.ppo_micro_batch_size: null").startswith("no equivalent: null")
    assert not [r.verl for r in t.given if "map knows" in r.note]


_MINIMAL = r"""
    python3 -m verl.trainer.main_ppo \
        algorithm.adv_estimator=grpo \
        actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
        actor_rollout_ref.rollout.name=sglang
    """


def test_actor_and_critic_shuffle(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.actor.shuffle=True", "critic.shuffle=True")
    assert t.values["actor.shuffle"] is True
    assert _row(t, "actor_rollout_ref.actor.shuffle=True") == "actor.shuffle=True"
    assert "critic.shuffle" not in t.values  # GRPO: no critic
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), "actor_rollout_ref.actor.shuffle=True")
    assert t.values["actor.shuffle"] is True and t.values["critic.shuffle"] is True  # verl's ${actor_rollout_ref.actor.shuffle}
    assert _row(t, "critic.shuffle: true") == "critic.shuffle=True"
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), "critic.shuffle=True")
    assert t.values["critic.shuffle"] is True and "actor.shuffle" not in t.values  # verl's false is megarl's


def test_val_kwargs_greedy_emits_no_sampling_values(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
                   "actor_rollout_ref.rollout.val_kwargs.temperature=0.7", "actor_rollout_ref.rollout.val_kwargs.top_k=20",
                   "actor_rollout_ref.rollout.val_kwargs.n=4")  # fmt: skip
    v = t.values
    assert v["rollout.val.greedy"] is True and v["rollout.val.n"] == 4
    assert not {"rollout.val.temperature", "rollout.val.top_p", "rollout.val.top_k"} & set(v)
    assert "do_sample is false" in _row(t, "actor_rollout_ref.rollout.val_kwargs.temperature=0.7")
    assert "do_sample is false" in _row(t, "actor_rollout_ref.rollout.val_kwargs.top_k=20")
    cfg = load_config(None, ["model.arch=tiny-demo", *(f"{k}={v[k]}" for k in v if k.startswith("rollout.val."))])
    assert (cfg.rollout.val.greedy, cfg.rollout.val.n) == (True, 4)  # megarl accepts what was emitted
    t = _translate(tmp_path, "grpo.sh", _MINIMAL)  # verl's defaults: greedy validation, nothing to emit
    assert not [k for k in t.values if k.startswith("rollout.val.")]


def test_val_kwargs_sampling(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
                   "actor_rollout_ref.rollout.val_kwargs.temperature=0.6", "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
                   "actor_rollout_ref.rollout.val_kwargs.n=8")  # fmt: skip
    v = t.values
    assert v["rollout.val.greedy"] is False and v["rollout.val.n"] == 8
    assert (v["rollout.val.temperature"], v["rollout.val.top_p"]) == (0.6, 0.95)
    assert v["rollout.val.top_k"] == -1  # verl's default, the whole vocabulary in both
    assert _row(t, "actor_rollout_ref.rollout.val_kwargs.top_p=0.95") == "rollout.val.top_p=0.95"
    assert _row(t, "actor_rollout_ref.rollout.val_kwargs.top_k: -1") == "rollout.val.top_k=-1"
    cfg = load_config(None, ["model.arch=tiny-demo", *(f"{k}={v[k]}" for k in v if k.startswith("rollout.val."))])
    assert (cfg.rollout.val.greedy, cfg.rollout.val.temperature, cfg.rollout.val.top_p) == (False, 0.6, 0.95)
    # do_sample alone: verl samples at its val_kwargs defaults (temperature 0), not the training ones
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.val_kwargs.do_sample=True")
    assert (t.values["rollout.val.temperature"], t.values["rollout.val.top_p"], t.values["rollout.val.top_k"]) == (0.0, 1.0, -1)


def test_ignore_eos_and_rollout_data_dir(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.ignore_eos=True",
                   "trainer.rollout_data_dir=/data/rollouts")  # fmt: skip
    assert t.values["rollout.sampling.ignore_eos"] is True
    assert _row(t, "actor_rollout_ref.rollout.ignore_eos=True") == "rollout.sampling.ignore_eos=True"
    assert t.values["trainer.rollout_data_dir"] == "/data/rollouts"
    assert _row(t, "trainer.rollout_data_dir=/data/rollouts") == "trainer.rollout_data_dir=/data/rollouts"
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "trainer.rollout_data_dir=null")
    assert "trainer.rollout_data_dir" not in t.values


def test_megatron_lora_takes_verls_alpha_default(tmp_path: Path):
    """verl's Megatron LoRA (model.lora.rank) defaults alpha to 32, megarl's to 16: the scale must
    stay verl's; a run without LoRA shows no LoRA row."""
    lora = _translate(tmp_path, "lora.sh", r"""
        python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer.yaml algorithm.adv_estimator=grpo \
            actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.model.lora.rank=16
        """)  # fmt: skip
    assert lora.values["actor.lora.rank"] == 16 and lora.values["actor.lora.alpha"] == 32.0
    plain = _translate(tmp_path, "plain.sh", r"""
        python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer.yaml algorithm.adv_estimator=grpo \
            actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
        """)  # fmt: skip
    assert not any(k.startswith("actor.lora") for k in plain.values)


def test_a_global_micro_batch_is_split_over_verls_data_parallel_ranks(tmp_path: Path):
    """verl's deprecated ppo_micro_batch_size is global: FSDP splits it over every GPU, Megatron over
    GPUs / (TP x PP) (its data-parallel ranks); megarl's micro_batch_size is per DP rank."""
    head = "python3 -m verl.trainer.main_ppo {} algorithm.adv_estimator=grpo trainer.n_gpus_per_node=8 " \
           "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.actor.ppo_micro_batch_size=16 {}"
    fsdp = _translate(tmp_path, "fsdp.sh", head.format("", ""))
    megatron = _translate(tmp_path, "mcore.sh", head.format("--config-name=ppo_megatron_trainer.yaml",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"))  # fmt: skip
    assert fsdp.values["actor.micro_batch_size"] == 2 and megatron.values["actor.micro_batch_size"] == 8


def _loads(t: Translation, tmp_path: Path):
    """megarl's loader takes the translation as the command writes it."""
    out = tmp_path / "written.yaml"
    out.write_text(yaml.safe_dump({"model": {"arch": "tiny-demo"}} | {k: v for k, v in t.nested().items() if k != "model"}))
    return load_config(out)


def test_kl_splits_into_the_reward_and_loss_settings(tmp_path: Path):
    """verl's KL penalty in the reward and KL loss each keep their coefficient and estimator:
    megarl's reward_coef / reward_estimator and loss_coef / loss_estimator, the shared coef and
    estimator left as megarl's."""
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.005",
                   "algorithm.kl_penalty=mse", "actor_rollout_ref.actor.use_kl_loss=True",
                   "actor_rollout_ref.actor.kl_loss_coef=0.02", "actor_rollout_ref.actor.kl_loss_type=kl",
                   "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=500")  # fmt: skip
    v = t.values
    assert _row(t, "algorithm.kl_ctrl.kl_coef=0.005") == "algorithm.kl.reward_coef=0.005"
    assert _row(t, "algorithm.kl_penalty=mse") == "algorithm.kl.reward_estimator=k2"
    assert _row(t, "actor_rollout_ref.actor.kl_loss_coef=0.02") == "algorithm.kl.loss_coef=0.02"
    assert _row(t, "actor_rollout_ref.actor.kl_loss_type=kl") == "algorithm.kl.loss_estimator=k1"
    assert (v["algorithm.kl.use_in_reward"], v["algorithm.kl.use_in_loss"]) == (True, True)
    assert (v["algorithm.kl.controller"], v["algorithm.kl.target"], v["algorithm.kl.horizon"]) == ("adaptive", 0.1, 500)
    assert "algorithm.kl.coef" not in v and "algorithm.kl.estimator" not in v
    kl = _loads(t, tmp_path).algorithm.kl
    assert (kl.reward_kl_coef, kl.reward_kl_estimator, kl.loss_kl_coef, kl.loss_kl_estimator) == (0.005, "k2", 0.02, "k1")
    # verl's default kl_penalty (kl) with the reward penalty on: k1 for the reward, megarl's k3 left to the loss
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "algorithm.use_kl_in_reward=True", "actor_rollout_ref.actor.use_kl_loss=True")
    assert _row(t, "algorithm.kl_penalty: kl") == "algorithm.kl.reward_estimator=k1"
    assert _loads(t, tmp_path).algorithm.kl.loss_kl_estimator == "k3"
    # without the flags verl reads neither
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "algorithm.kl_ctrl.kl_coef=0.005", "actor_rollout_ref.actor.kl_loss_coef=0.02")
    assert "use_kl_in_reward=true" in _row(t, "algorithm.kl_ctrl.kl_coef=0.005")
    assert "use_kl_loss=true" in _row(t, "actor_rollout_ref.actor.kl_loss_coef=0.02")
    assert not [k for k in t.values if k.startswith("algorithm.kl.")]


@pytest.mark.parametrize("verl_name,ours", [("low_var_kl+", "k3+"), ("k3+", "k3+"), ("kl+", "k1+"), ("k1+", "k1+"),
                                            ("abs+", "abs+"), ("mse+", "k2"), ("k2+", "k2"), ("abs", "abs")])  # fmt: skip
def test_straight_through_kl_estimators_translate(tmp_path: Path, verl_name: str, ours: str):
    """verl's "+" variants (the estimator's value, k2's gradient) are megarl's estimators of the same name."""
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "algorithm.use_kl_in_reward=True", f"algorithm.kl_penalty={verl_name}",
                   "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.kl_loss_type={verl_name}")  # fmt: skip
    assert _row(t, f"actor_rollout_ref.actor.kl_loss_type={verl_name}") == f"algorithm.kl.loss_estimator={ours}"
    assert _row(t, f"algorithm.kl_penalty={verl_name}") == f"algorithm.kl.reward_estimator={ours}"
    kl = _loads(t, tmp_path).algorithm.kl
    assert (kl.loss_kl_estimator, kl.reward_kl_estimator) == (ours, ours)


_KL_LOSS = ("actor_rollout_ref.actor.use_kl_loss=True",)


def test_log_prob_micro_batches_of_both_passes_are_one_setting(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, *_KL_LOSS, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4")  # fmt: skip
    assert t.values["actor.logprob_micro_batch_size"] == 4  # the smaller, said in both rows
    for key in ("rollout.log_prob_micro_batch_size_per_gpu=20", "ref.log_prob_micro_batch_size_per_gpu=4"):
        row = [r for r in t.given if r.verl == f"actor_rollout_ref.{key}"][0]
        assert row.sets == {"actor.logprob_micro_batch_size": 4}
        assert row.note == "megarl has one setting for both log-prob passes: the smaller of rollout's 20 and ref's 4"
    # no reference (no KL): verl never runs the ref's pass, its size is not read
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4")  # fmt: skip
    assert t.values["actor.logprob_micro_batch_size"] == 20
    assert _row(t, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4").startswith("no equivalent: no reference")
    # verl's deprecated global size, split over its data-parallel ranks (8 GPUs under FSDP)
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.log_prob_micro_batch_size=64")
    assert _row(t, "actor_rollout_ref.rollout.log_prob_micro_batch_size=64") == "actor.logprob_micro_batch_size=8"
    assert _loads(t, tmp_path).actor.logprob_micro_batch_size == 8


def test_log_prob_token_budgets_only_with_dynamic_batches(tmp_path: Path):
    given = ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24000")
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, *_KL_LOSS, *given)
    assert "log_prob_use_dynamic_bsz=true" in _row(t, f"actor_rollout_ref.{given[0].split('.', 1)[1]}")
    assert "actor.logprob_max_tokens_per_gpu" not in t.values
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, *_KL_LOSS, *given, "actor_rollout_ref.actor.use_dynamic_bsz=True",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16000")  # fmt: skip
    assert t.values["actor.logprob_max_tokens_per_gpu"] == 24000 and t.values["actor.max_tokens_per_gpu"] == 16000
    assert "the smaller of rollout's 32768 and ref's 24000" in [r for r in t.given if r.verl == given[0]][0].note
    # the pass's own switch: the rollout's alone, at verl's default budget (the actor's ppo_max_token_len_per_gpu)
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12000")  # fmt: skip
    assert _row(t, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True") == "actor.logprob_max_tokens_per_gpu=12000"
    assert _loads(t, tmp_path).actor.logprob_max_tokens_per_gpu == 12000


def test_critic_forward_micro_batches(tmp_path: Path):
    keys = ("critic.forward_micro_batch_size_per_gpu=16", "critic.forward_max_token_len_per_gpu=30000")
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), *keys, "critic.use_dynamic_bsz=True")
    assert _row(t, keys[0]) == "critic.logprob_micro_batch_size=16"
    assert _row(t, keys[1]) == "critic.logprob_max_tokens_per_gpu=30000"
    assert t.values["critic.max_tokens_per_gpu"] == 32768  # verl's critic default budget, not the actor's
    critic = _loads(t, tmp_path).critic
    assert (critic.logprob_micro_batch_size, critic.logprob_max_tokens_per_gpu) == (16, 30000)
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), *keys)
    assert "use_dynamic_bsz=true" in _row(t, keys[1]) and "critic.logprob_max_tokens_per_gpu" not in t.values
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), "critic.forward_micro_batch_size=64")
    assert _row(t, "critic.forward_micro_batch_size=64") == "critic.logprob_micro_batch_size=8"  # global / 8 GPUs
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, *keys)  # GRPO: no critic
    assert not [k for k in t.values if k.startswith("critic.")]
    assert _row(t, keys[0]).startswith("no equivalent: no critic")


def test_warmup_ratio_min_lr_ratio_and_wsd(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
                   "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "actor_rollout_ref.actor.optim.warmup_style=wsd",
                   "actor_rollout_ref.actor.optim.lr=2e-6")  # fmt: skip
    assert _row(t, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05") == "actor.optimizer.warmup_ratio=0.05"
    assert _row(t, "actor_rollout_ref.actor.optim.min_lr_ratio=0.1") == "actor.optimizer.min_lr_ratio=0.1"
    assert _row(t, "actor_rollout_ref.actor.optim.warmup_style=wsd") == "actor.optimizer.schedule=wsd"
    optimizer = _loads(t, tmp_path).actor.optimizer
    assert (optimizer.warmup_ratio, optimizer.schedule, optimizer.wsd_decay_ratio) == (0.05, "wsd", 0.1)
    assert optimizer.final_lr == pytest.approx(2e-7) and optimizer.warmup_steps_of(200) == 10
    # lr_warmup_steps > 0 wins in verl; a min_lr beside min_lr_ratio: megarl takes the ratio
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps=3", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
                   "actor_rollout_ref.actor.optim.min_lr=1e-7", "actor_rollout_ref.actor.optim.lr_scheduler_type=wsd")  # fmt: skip
    assert "lr_warmup_steps is set and wins" in _row(t, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05")
    assert "megarl takes one of them, the ratio" in _row(t, "actor_rollout_ref.actor.optim.min_lr=1e-7")
    assert t.values["actor.optimizer.schedule"] == "wsd"
    optimizer = _loads(t, tmp_path).actor.optimizer
    assert (optimizer.warmup_ratio, optimizer.min_lr, optimizer.min_lr_ratio) == (None, 0.0, 0.1)
    # lr_warmup_steps 0 (or verl's -1) leaves the ratio to verl
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps=0")  # fmt: skip
    assert _loads(t, tmp_path).actor.optimizer.warmup_ratio == 0.1
    # the critic's optim the same
    t = _translate(tmp_path, "ppo.sh", _MINIMAL.replace("grpo", "gae"), "critic.optim.lr_warmup_steps_ratio=0.02",
                   "critic.optim.min_lr_ratio=0.5", "critic.optim.warmup_style=wsd")  # fmt: skip
    critic = _loads(t, tmp_path).critic.optimizer
    assert (critic.warmup_ratio, critic.min_lr_ratio, critic.schedule) == (0.02, 0.5, "wsd")


def test_a_config_with_the_kl_split_and_ratios_is_written_and_accepted(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    script = _write(tmp_path, "run.sh", GRPO_GSM8K)
    out = tmp_path / "megarl.yaml"
    assert main(["config", "--from-verl", str(script), "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.01",
                 "algorithm.kl_penalty=kl", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                 "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "actor_rollout_ref.actor.optim.warmup_style=cosine",
                 "--out", str(out)]) == 0  # fmt: skip
    assert "megarl plan accepts it" in capsys.readouterr().out
    cfg = load_config(out)
    kl = cfg.algorithm.kl
    assert (kl.reward_kl_coef, kl.reward_kl_estimator, kl.loss_kl_coef, kl.loss_kl_estimator) == (0.01, "k1", 0.001, "k3")
    assert (cfg.actor.optimizer.warmup_ratio, cfg.actor.optimizer.min_lr_ratio) == (0.1, 0.1)
    assert cfg.actor.logprob_micro_batch_size == 40


def test_sglang_engine_kwargs_become_rollout_engine_kwargs(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
                   "+actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=4096",
                   "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache=null")  # fmt: skip
    assert _row(t, "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton") == "rollout.engine_kwargs.attention_backend=triton"
    assert _row(t, "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache=null").startswith("no equivalent: null")
    assert t.nested()["rollout"]["engine_kwargs"] == {"attention_backend": "triton", "chunked_prefill_size": 4096}
    assert _loads(t, tmp_path).rollout.engine_kwargs == {"attention_backend": "triton", "chunked_prefill_size": 4096}
    # the dict given whole (nulls left out), and a YAML config's entries
    t = _translate(tmp_path, "grpo.sh", _MINIMAL,
                   "actor_rollout_ref.rollout.engine_kwargs.sglang={attention_backend: triton, max_prefill_tokens: null}")  # fmt: skip
    assert t.values["rollout.engine_kwargs"] == {"attention_backend": "triton"}
    path = _write(tmp_path, "dump.yaml", """
        actor_rollout_ref:
          model: {path: /m/Qwen3-8B}
          rollout: {name: sglang, engine_kwargs: {sglang: {chunked_prefill_size: 8192}, vllm: {}}}
        """)  # fmt: skip
    t = translate(read_verl(path, env={}))
    assert t.nested()["rollout"]["engine_kwargs"] == {"chunked_prefill_size": 8192}
    assert _row(t, "actor_rollout_ref.rollout.engine_kwargs.vllm: {}").startswith("vLLM-only")
    assert is_verl_key("actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend")


def test_swanlab_logger(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "trainer.logger=[console,swanlab]")
    assert _row(t, "trainer.logger=[console,swanlab]") == "trainer.loggers=['console', 'swanlab']"
    assert _loads(t, tmp_path).trainer.loggers == ["console", "swanlab"]


def test_data_custom_cls_chat_template_kwargs_and_reward_fn_key(tmp_path: Path):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "data.custom_cls.path=/code/my_dataset.py", "data.custom_cls.name=JsonlPrompts",
                   "+data.apply_chat_template_kwargs.enable_thinking=False", "data.reward_fn_key=source")  # fmt: skip
    assert _row(t, "data.custom_cls.path=/code/my_dataset.py") == "data.custom_cls.path=/code/my_dataset.py"
    assert _row(t, "data.custom_cls.name=JsonlPrompts") == "data.custom_cls.name=JsonlPrompts"
    assert _row(t, "+data.apply_chat_template_kwargs.enable_thinking=False") == "data.apply_chat_template_kwargs.enable_thinking=False"
    assert _row(t, "data.reward_fn_key=source") == "data.reward_fn_key=source"
    data = _loads(t, tmp_path).data
    assert (str(data.custom_cls.path), data.custom_cls.name) == ("/code/my_dataset.py", "JsonlPrompts")
    assert data.apply_chat_template_kwargs == {"enable_thinking": False} and data.reward_fn_key == "source"
    # a dump's nulls: verl's own dataset, nothing set
    path = _write(tmp_path, "dump.yaml", """
        actor_rollout_ref: {model: {path: /m/Qwen3-8B}, rollout: {name: sglang}}
        data: {custom_cls: {path: null, name: null}, apply_chat_template_kwargs: {}, reward_fn_key: data_source}
        """)  # fmt: skip
    t = translate(read_verl(path, env={}))
    assert "data.custom_cls.path" not in t.values and "data.custom_cls.name" not in t.values
    assert "custom_cls.path" in _row(t, "data.custom_cls.name: null")
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "data.custom_cls={path: /code/d.py, name: D}",
                   "data.apply_chat_template_kwargs={enable_thinking: false}")  # fmt: skip
    assert t.values["data.custom_cls"] == {"path": "/code/d.py", "name": "D"}
    assert _loads(t, tmp_path).data.apply_chat_template_kwargs == {"enable_thinking": False}


def _note(t: Translation, verl_text: str) -> str:
    """The note of the row whose verl key is ``verl_text``."""
    (row,) = [r for r in t.given + t.defaults + t.choices if r.verl == verl_text]
    return row.note


def _own_model_run(path: str) -> str:
    return GRPO_GSM8K.replace("actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", f"actor_rollout_ref.model.path={path}")


def test_a_model_path_without_a_built_in_name_keeps_model_path(tmp_path: Path, capsys):
    t = _translate(tmp_path, "run.sh", _own_model_run("$HOME/models/my-finetune"))
    assert t.values["model.path"] == "/home/u/models/my-finetune" and "model.arch" not in t.values
    assert "add model.arch=NAME after the run" in _note(t, "actor_rollout_ref.model.path=$HOME/models/my-finetune")
    # a megarl key after the run is taken as it is (model.arch: plan without the weights)
    t = _translate(tmp_path, "run.sh", _own_model_run("/models/my-finetune"), "model.arch=qwen2-7b")
    assert (t.values["model.path"], t.values["model.arch"]) == ("/models/my-finetune", "qwen2-7b")
    assert _row(t, "model.arch=qwen2-7b") == "model.arch=qwen2-7b"
    # a local directory with a config.json: the plan reads it, no model.arch needed
    model = tmp_path / "b1" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "intermediate_size": 128, "vocab_size": 256}))  # fmt: skip
    script = _write(tmp_path, "run1.sh", _own_model_run(str(model)))
    out = tmp_path / "megarl.yaml"
    assert main(["config", "--from-verl", str(script), "--out", str(out)]) == 0
    assert "a local model directory: megarl plan reads its config.json" in capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.model.path == str(model) and cfg.model.arch is None


def test_a_variable_set_nowhere_stays_as_written_through_assignments(tmp_path: Path):
    run = 'DATA_DIR=${DATA_DIR}\nTRAIN="${DATA_DIR}/train.parquet"\n' + GRPO_GSM8K.replace(
        "data.train_files=$HOME/data/gsm8k/train.parquet", 'data.train_files="${DATA_DIR}/train.parquet"').replace(
        "data.val_files=$HOME/data/gsm8k/test.parquet", "data.val_files=$TRAIN")
    t = _translate(tmp_path, "run1.sh", run)
    assert t.values["data.train_files"] == ["${DATA_DIR}/train.parquet"]
    assert t.values["data.val_files"] == ["${DATA_DIR}/train.parquet"]
    assert [n for n in t.notes if "DATA_DIR" in n] == [
        "$DATA_DIR is not set in the script or the environment: kept as ${DATA_DIR}; set it, or give the key it feeds "
        "as an override after the script"]  # fmt: skip


def test_key_interpolations_resolve_where_the_map_knows_the_key_else_stay_with_a_note(tmp_path: Path):
    path = _write(tmp_path, "run.yaml", """
        actor_rollout_ref: {model: {path: Qwen/Qwen2.5-3B-Instruct}, rollout: {name: sglang, n: 4}}
        algorithm: {adv_estimator: grpo}
        trainer:
          experiment_name: ${trainer.project_name}_${.project_name}
          default_local_dir: /ckpt/${oc.select:trainer.experiment_name,x}/${my_group.dir}
        data: {train_files: ['${oc.decode:"a"}']}
        """)  # fmt: skip
    t = translate(read_verl(path, env={}))
    assert t.values["trainer.experiment"] == "verl_examples_verl_examples"  # verl's default project_name
    assert t.values["trainer.output_dir"] == "/ckpt/verl_examples_verl_examples/${my_group.dir}"
    assert t.values["data.train_files"] == ['${oc.decode:"a"}']
    assert [n.partition(" (")[0] for n in t.notes] == ["${my_group.dir} in trainer.default_local_dir is not resolved",
                                                      '${oc.decode:"a"} in data.train_files is not resolved']  # fmt: skip


def test_oc_env_reads_the_environment_like_a_shell_variable(tmp_path: Path):
    run = "export RUN_TAG=t1\n" + _MINIMAL.replace("rollout.name=sglang", "rollout.name=sglang \\\n"
        "trainer.default_local_dir='checkpoints/x/${oc.env:USER}_exp' trainer.project_name=${oc.env:RUN_TAG} \\\n"
        "trainer.experiment_name='${oc.env:NOPE,e1}' data.train_files='/d/${oc.env:NOPE}.parquet'")  # fmt: skip
    t = _translate(tmp_path, "run.sh", run, env={"USER": "alice"})
    assert t.values["trainer.output_dir"] == "checkpoints/x/alice_exp"
    assert (t.values["trainer.project"], t.values["trainer.experiment"]) == ("t1", "e1")
    assert t.values["data.train_files"] == ["/d/${oc.env:NOPE}.parquet"]
    assert t.notes == ["${oc.env:NOPE} in data.train_files: $NOPE is not set in the environment: kept as ${oc.env:NOPE}; "
                       "set it, or give data.train_files as an override after the run"]  # fmt: skip


@pytest.mark.parametrize("tail", [" $@ 2>&1 | tee log.txt", " $@ 2>&1 | tee -a logs/run.log", " > log 2>&1", " &> log",
                                  " $@ >> out.log 2> err.log && echo done", " 2>&1 |& tee log.txt"])  # fmt: skip
def test_redirections_and_a_pipeline_after_the_verl_command_are_left_out_with_a_note(tmp_path: Path, tail: str):
    t = _translate(tmp_path, "run.sh", GRPO_GSM8K.replace(" $@\n", tail + "\n"))
    assert t.values == _translate(tmp_path, "plain.sh", GRPO_GSM8K).values
    assert any("shell redirections, not verl keys: left out" in n or "piped to" in n for n in t.notes), t.notes
    if "tee" in tail:
        assert any(f"piped to `tee{tail.split('tee')[-1]}`: left out" in n for n in t.notes), t.notes


@pytest.mark.parametrize("broken", ["trainer.test_freq=5 \\  \n", "trainer.test_freq=5 \\\n    # test every 5 steps\n"])
def test_keys_after_a_broken_continuation_are_named_in_a_note(tmp_path: Path, broken: str):
    t = _translate(tmp_path, "run.sh", GRPO_GSM8K.replace("trainer.test_freq=5 \\\n", broken))
    assert "trainer.total_epochs" not in {k for r in t.given for k in r.sets}  # dropped, as bash drops them
    (note,) = [n for n in t.notes if "after the verl command ended" in n]
    assert note.startswith("line 41: 1 key=value word(s) after the verl command ended (line 40)" if "#" in broken else
                           "line 40: 1 key=value word(s) after the verl command ended (line 39)"), note  # fmt: skip
    assert "(trainer.total_epochs=15, ...)" in note


@pytest.mark.parametrize("top_k", [0, -1])
def test_verls_no_top_k_is_megarls_whole_vocabulary(tmp_path: Path, top_k: int):
    t = _translate(tmp_path, "run.sh", _MINIMAL, f"actor_rollout_ref.rollout.top_k={top_k}",
                   "actor_rollout_ref.rollout.val_kwargs.do_sample=True", f"actor_rollout_ref.rollout.val_kwargs.top_k={top_k}")
    assert (t.values["rollout.sampling.top_k"], t.values["rollout.val.top_k"]) == (-1, -1)
    assert _note(t, f"actor_rollout_ref.rollout.top_k={top_k}") == f"verl's {top_k}: no top-k, the whole vocabulary (megarl's -1)"
    assert validate_config(t.nested()).rollout.val.top_k == -1  # megarl accepts them (not "samples nothing")


def test_verls_hf_rollout_is_megarls_torch_engine(tmp_path: Path, capsys):
    script = _write(tmp_path, "run.sh", GRPO_GSM8K.replace("rollout.name=vllm", "rollout.name=hf"))
    t = translate(read_verl(script, env={"HOME": "/home/u"}))
    assert t.values["rollout.engine"] == "torch" and "rollout.tp" not in t.values
    assert "verl's HF rollout" in _note(t, "actor_rollout_ref.rollout.name=hf")
    assert "vLLM" not in _note(t, "actor_rollout_ref.rollout.name=hf")
    assert _row(t, "actor_rollout_ref.rollout.tensor_model_parallel_size=2").startswith("no equivalent: verl's HF rollout")
    assert main(["config", "--from-verl", str(script), "--out", str(tmp_path / "m.yaml")]) == 0
    assert load_config(tmp_path / "m.yaml").rollout.engine == "torch"


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.lora_adapter_path=/ckpt/adapter", "critic.model.lora_rank=8",
                                 "actor_rollout_ref.actor.ppo_mini_bach_size=64"])  # a typo: the user's value would be lost
def test_a_key_that_would_make_the_run_differ_stops_the_translation_unless_accepted(tmp_path: Path, capsys, key: str):
    script = _write(tmp_path, "run.sh", GRPO_GSM8K.replace("algorithm.adv_estimator=grpo", "algorithm.adv_estimator=gae"))
    out = tmp_path / "m.yaml"
    with pytest.raises(ConfigError, match=rf"would train differently from verl \({re.escape(key)}: .*--accept-differences"):
        from_verl(str(script), [key, "actor_rollout_ref.model.lora_rank=8"], str(out))
    assert not out.exists()
    main(["config", "--from-verl", str(script), key, "--out", str(out), "--accept-differences"])  # (a critic's 7B: plan refuses)
    said = capsys.readouterr().out
    assert out.exists() and ("check its spelling" if "bach" in key else "the megarl run would differ from verl's") in said
    t = _translate(tmp_path, "run.sh", GRPO_GSM8K, "actor_rollout_ref.model.lora_adapter_path=null", "critic.model.lora_rank=0")
    assert not t.differences  # unset: nothing to carry


_ESTIMATOR_NAMES = "gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax"
_KL_NAMES = "kl, k1, abs, mse, k2, low_var_kl, k3, kl+, k1+, abs+, mse+, k2+, low_var_kl+, k3+"


@pytest.mark.parametrize("override, needs, why, accepted", [
    ("algorithm.adv_estimator=opo", (), "megarl has no opo advantage estimator", _ESTIMATOR_NAMES),
    ("algorithm.adv_estimator=grpoo", (), "megarl has no grpoo advantage estimator", _ESTIMATOR_NAMES),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", (), "megarl has no clip_cov policy loss", "vanilla, gspo"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanila", (), "megarl has no vanila policy loss", "vanilla, gspo"),
    ("actor_rollout_ref.actor.kl_loss_type=k4", _KL_LOSS, "megarl has no k4 KL estimator", _KL_NAMES),
    ("actor_rollout_ref.actor.kl_loss_type=full", _KL_LOSS, "full (the whole-vocabulary KL) needs", _KL_NAMES),
    ("algorithm.kl_penalty=k3++", ("algorithm.use_kl_in_reward=True",), "megarl has no k3++ KL estimator", _KL_NAMES),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean", (), "megarl has no seq-mean loss aggregation",
     "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("actor_rollout_ref.actor.optim.warmup_style=exponential", (), "megarl has no exponential learning-rate schedule",
     "constant, cosine, linear, wsd"),
    ("actor_rollout_ref.actor.optim.lr_decay_style=inverse-square-root", (),
     "megarl has no inverse-square-root learning-rate schedule", "constant, cosine, linear, wsd"),
    ("actor_rollout_ref.rollout.name=trtllm", (), "trtllm is not a rollout engine megarl knows", "sglang, vllm, hf"),
    ("data.truncation=middle", (), "megarl has no middle truncation", "error, left, right"),
    ("trainer.device=npu", (), "megarl runs on cuda (or cpu), not npu", "cuda, cpu"),
    ("trainer.resume_mode=always", (), "always is not a resume mode", "auto, disable, resume_path"),
    ("actor_rollout_ref.actor.router_replay.mode=R2", (), "R2: megarl replays the engine's routing only", "R3, disabled"),
    ("actor_rollout_ref.model.lora.target_modules=[linear_qkv,mlp]", ("actor_rollout_ref.model.lora.rank=8",),
     "mlp is not a Megatron linear", "linear_qkv, linear_proj, linear_fc1, linear_fc2, all-linear"),
])  # fmt: skip
def test_a_value_megarl_cannot_take_stops_the_translation_naming_key_value_and_accepted(
    tmp_path: Path, override: str, needs: tuple[str, ...], why: str, accepted: str
):
    """Left out, these keys would train under megarl's default instead (grpo for opo): the
    translation stops with one line naming the key as given, the value and the values accepted."""
    with pytest.raises(ConfigError) as err:
        _translate(tmp_path, "grpo.sh", _MINIMAL, *needs, override)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"verl key {override}: {why}")
    assert f"the values megarl takes here are {accepted};" in msg
    assert msg.endswith(f"give {override.partition('=')[0]}=VALUE after the run")


def test_a_refused_value_is_one_error_line_from_the_command_and_no_config_is_written(tmp_path: Path, capsys):
    script = _write(tmp_path, "run.sh", GRPO_GSM8K.replace("adv_estimator=grpo", "adv_estimator=gpg"))
    out = tmp_path / "m.yaml"
    assert main(["config", "--from-verl", str(script), "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: verl key algorithm.adv_estimator=gpg: megarl has no gpg")
    assert not out.exists()
    # the same value in a key verl does not read here (no KL loss) stays a row
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, "actor_rollout_ref.actor.kl_loss_type=k4")
    assert "use_kl_loss=true" in _row(t, "actor_rollout_ref.actor.kl_loss_type=k4")


_RC = "algorithm.rollout_correction"


def test_rollout_correction_importance_sampling_is_tis(tmp_path: Path):
    """verl's decoupled mode: truncated importance weights pi_old / pi_rollout = megarl's tis with
    the recomputed old log-probs (megarl's default)."""
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.rollout_is=token", f"{_RC}.rollout_is_threshold=3.0",
                   f"{_RC}.bypass_mode=false", f"{_RC}.rollout_is_batch_normalize=false")  # fmt: skip
    assert _row(t, f"{_RC}.rollout_is=token") == "algorithm.tis.level=token"
    assert _row(t, f"{_RC}.rollout_is_threshold=3.0") == "algorithm.tis.cap=3.0"
    assert _row(t, f"{_RC}.bypass_mode=false") == "algorithm.old_logprobs=recompute"
    assert _row(t, f"{_RC}.rollout_is_batch_normalize=false").startswith("no equivalent: false: the truncated weights")
    alg = _loads(t, tmp_path).algorithm
    assert (alg.tis.level, alg.tis.cap, alg.old_logprobs) == ("token", 3.0, "recompute")
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.rollout_is=sequence")  # verl's default threshold, megarl's cap
    assert t.values["algorithm.tis.level"] == "sequence" and "algorithm.tis.cap" not in t.values
    assert _loads(t, tmp_path).algorithm.tis.cap == 2.0
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.rollout_is=null", f"{_RC}.rollout_is_threshold=3.0")
    assert _row(t, f"{_RC}.rollout_is=null").startswith("no equivalent: null: no importance weights")
    assert "rollout_is set" in _row(t, f"{_RC}.rollout_is_threshold=3.0") and "algorithm.tis.cap" not in t.values


@pytest.mark.parametrize("option, threshold, level, low, high", [
    ("token_k1", "2.0", "token", 0.5, 2.0),          # one bound u: verl's lower is 1/u
    ("seq_sum_k1", "0.5_4.0", "sequence", 0.25, 2.0),  # -log r in [log 0.5, log 4]: r in [1/4, 2]
    ("seq_mean_k1", "0.999_1.001", "geometric", 1 / 1.001, 1 / 0.999),
])  # fmt: skip
def test_rollout_correction_rejection_with_k1_options_is_mis(tmp_path: Path, option, threshold, level, low, high):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.rollout_rs={option}", f"{_RC}.rollout_rs_threshold='{threshold}'")
    v = t.values
    assert (v["algorithm.mis.level"], v["algorithm.mis.low"], v["algorithm.mis.high"]) == (level, pytest.approx(low), pytest.approx(high))
    assert "megarl's mis drops them from the policy-gradient term only" in _note(t, f"{_RC}.rollout_rs={option}")
    assert "its row gives algorithm.mis.low / high" in _row(t, f"{_RC}.rollout_rs_threshold='{threshold}'")
    assert not t.differences
    mis = _loads(t, tmp_path).algorithm.mis
    assert (mis.level, mis.low, mis.high) == (level, pytest.approx(low), pytest.approx(high))


def _verl_k1_rejection(log_ratio, mask, option: str, lower: float, upper: float):
    """verl's rollout_corr_helper.compute_rollout_rejection_mask for the k1 options, from its definition:
    the statistic -log r (token, or its masked sum / mean over the sequence) kept in [log lower, log upper]."""
    import math

    import torch

    k1 = -log_ratio.clamp(-20, 20)
    if option == "token_k1":
        stat = k1
    else:
        total = (k1 * mask).sum(-1, keepdim=True)
        stat = (total if option == "seq_sum_k1" else total / mask.sum(-1, keepdim=True)).expand_as(k1)
    return ((stat >= math.log(lower)) & (stat <= math.log(upper))).to(torch.float32)


@pytest.mark.parametrize("option, threshold", [("token_k1", "1.5"), ("seq_sum_k1", "0.6_1.4"), ("seq_mean_k1", "0.9_1.2")])
def test_translated_mis_rejects_what_verls_rejection_rejects(tmp_path: Path, option: str, threshold: str):
    import torch

    from megarl.algos.mismatch import mis_mask

    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.rollout_rs={option}", f"{_RC}.rollout_rs_threshold='{threshold}'")
    mis = _loads(t, tmp_path).algorithm.mis
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, 12, generator=gen) * 3  # [B, R]
    train = rollout + torch.randn(64, 12, generator=gen) * 0.3
    mask = (torch.arange(12) < torch.randint(1, 13, (64, 1), generator=gen)).float()
    lower, _, upper = threshold.partition("_")
    bounds = (1 / float(threshold), float(threshold)) if not upper else (float(lower), float(upper))
    verl = _verl_k1_rejection(train - rollout, mask, option, *bounds)
    ours = mis_mask(train, rollout, mask, mis.level, mis.low, mis.high)
    assert 0 < (verl * mask).sum() < mask.sum()  # some kept, some rejected: the comparison means something
    torch.testing.assert_close(ours * mask, verl * mask)


def test_rollout_correction_bypass_mode_is_the_engines_old_logprobs(tmp_path: Path, capsys, monkeypatch):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, f"{_RC}.bypass_mode=true", f"{_RC}.loss_type=ppo_clip",
                   f"{_RC}.rollout_is=sequence", f"{_RC}.rollout_is_threshold=2.0")  # fmt: skip
    assert _row(t, f"{_RC}.bypass_mode=true") == "algorithm.old_logprobs=engine"
    assert "algorithm.old_logprobs=engine" in _row(t, f"{_RC}.loss_type=ppo_clip")
    assert "no importance weights in bypass mode" in _row(t, f"{_RC}.rollout_is=sequence")
    assert "algorithm.tis.level" not in t.values and not t.differences
    assert _loads(t, tmp_path).algorithm.old_logprobs == "engine"  # and the planner's tis/mis check has nothing to refuse
    monkeypatch.setenv("HOME", "/home/u")
    script = _write(tmp_path, "run.sh", GRPO_GSM8K.replace("trainer.total_epochs=15", f"trainer.total_epochs=15 {_RC}.bypass_mode=True"))
    assert main(["config", "--from-verl", str(script), "--out", str(tmp_path / "m.yaml")]) == 0
    assert load_config(tmp_path / "m.yaml").algorithm.old_logprobs == "engine"


@pytest.mark.parametrize("overrides, why", [
    ((f"{_RC}.bypass_mode=true", f"{_RC}.rollout_rs=token_k1", f"{_RC}.rollout_rs_threshold=2.0"),
     "in bypass mode verl rejects against the policy being trained"),
    ((f"{_RC}.rollout_rs=token_k3", f"{_RC}.rollout_rs_threshold=0.01"), "verl's k2 / k3 / max options"),
    ((f"{_RC}.rollout_rs='token_k1,seq_mean_k1'", f"{_RC}.rollout_rs_threshold=2.0"), "chained options"),
    ((f"{_RC}.rollout_is=token", f"{_RC}.rollout_is_batch_normalize=true"), "not normalised to a batch mean of 1"),
])  # fmt: skip
def test_rollout_corrections_megarl_lacks_would_make_the_run_differ(tmp_path: Path, overrides, why):
    t = _translate(tmp_path, "grpo.sh", _MINIMAL, *overrides)
    (row,) = t.differences
    assert why in row.note and row.group == "not supported yet"
    assert not [k for k in t.values if k.startswith("algorithm.mis")]


@pytest.mark.parametrize("overrides, message", [
    ((f"{_RC}.bypass_mode=true", f"{_RC}.loss_type=reinforce"),
     f"verl key {_RC}.loss_type=reinforce: megarl has no reinforce loss in bypass mode"),
    ((f"{_RC}.rollout_is=tokens",), f"verl key {_RC}.rollout_is=tokens: megarl has no tokens importance sampling"),
    ((f"{_RC}.rollout_rs=token_k9", f"{_RC}.rollout_rs_threshold=2.0"),
     f"verl key {_RC}.rollout_rs=token_k9: token_k9 is not a rejection option verl knows"),
    ((f"{_RC}.rollout_rs=token_k1",), f"verl needs {_RC}.rollout_rs_threshold with rollout_rs=token_k1"),
    ((f"{_RC}.rollout_rs=token_k1", f"{_RC}.rollout_rs_threshold=abc"), f"{_RC}.rollout_rs_threshold=abc is not verl's threshold"),
    ((f"{_RC}.rollout_rs_threshold=0", f"{_RC}.rollout_rs=token_k1"), f"{_RC}.rollout_rs_threshold=0 is not verl's threshold"),
])  # fmt: skip
def test_rollout_correction_values_megarl_cannot_take_stop_the_translation(tmp_path: Path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _translate(tmp_path, "grpo.sh", _MINIMAL, *overrides)


def test_unquoted_hydra_lists_with_shell_variables_and_interpolations(tmp_path: Path):
    """``[$HOME/a.parquet,$HOME/b.parquet]`` as verl users write it unquoted: each item expanded as
    the shell does; a ``${VAR}`` left unset or a Hydra ``${oc.env:...}`` inside the list keeps it a list."""
    t = _translate(tmp_path, "run.sh", r"""
        DATA=/data
        python3 -m verl.trainer.main_ppo \
            algorithm.adv_estimator=grpo \
            actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
            data.train_files=[$HOME/a.parquet,$HOME/b.parquet,${DATA}/c.parquet,${MORE:-/x}/d.parquet] \
            data.val_files=[${UNSET}/v.parquet,$HOME/w.parquet] \
            trainer.logger='[${oc.env:LOGGER},console]'
        """, env={"HOME": "/home/u", "LOGGER": "jsonl"})  # fmt: skip
    v = t.values
    assert v["data.train_files"] == ["/home/u/a.parquet", "/home/u/b.parquet", "/data/c.parquet", "/x/d.parquet"]
    assert v["data.val_files"] == ["${UNSET}/v.parquet", "/home/u/w.parquet"]  # kept as written, with a note
    assert any(n.startswith("$UNSET is not set") for n in t.notes)
    assert v["trainer.loggers"] == ["jsonl", "console"]
    assert parse_hydra("[${oc.select:a.b,${c}}/x, {k: ${d}}]") == ["${oc.select:a.b,${c}}/x", {"k": "${d}"}]
