"""reward.combine and reward.judge before launch: unknown components refused by the plan, a data
source no row has, a judge template with an unknown placeholder and a judge directory without a
model refused by the preflight's checks; the judge and reward-model roles sized from config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.data.datasets import PromptRecord
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.reward_checks import combine_findings, reward_roles

ROOT = Path(__file__).resolve().parents[3]


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny_grpo.yaml", list(overrides))


def test_the_plan_refuses_a_component_that_names_nothing():
    with pytest.raises(PlanError, match=r"reward.combine\['reverse_digits'\] names the component 'gsm9k'.*use one of"):
        make_plan(_cfg("reward.combine={reverse_digits: {gsm9k: 1.0}}"))


def test_preflight_checks_the_judge_and_the_combined_sources(tmp_path):
    from megarl.models.tiny import build_tiny_model

    judge = build_tiny_model(tmp_path / "judge", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64)
    (tmp_path / "template.txt").write_text("Q {prompt} A {response} ref {answer}")
    rows = [("data.train_files[0] (t.parquet)", [PromptRecord("reverse_digits", "123", "321", 0)])]
    cfg = _cfg("reward.combine={reverse_digits: {reverse_digits: 1.0, judge: 1.0}, gsm8k: {judge: 1.0}}",
               f"reward.judge.model={tmp_path}", f"reward.judge.prompt_template={tmp_path / 'template.txt'}")  # fmt: skip
    found = {(f.field, f.message) for f in combine_findings(cfg, rows)}
    assert ("reward.combine", "['gsm8k'] is a data_source no row of the data files has (they have reverse_digits); fix the key") in found
    assert any(field == "reward.judge.model" and "has no config.json" in msg for field, msg in found)
    assert any(field == "reward.judge.prompt_template" and "unknown placeholder {answer}" in msg for field, msg in found)
    (tmp_path / "template.txt").write_text("Q {prompt} A {response} ref {ground_truth}")
    good = _cfg("reward.combine={reverse_digits: {judge: 1.0}}", f"reward.judge.model={judge}",
                f"reward.judge.prompt_template={tmp_path / 'template.txt'}")  # fmt: skip
    assert combine_findings(good, rows) == []
    # a reward model (a sequence classifier) given as the judge would judge with a random LM head
    from megarl.models.tiny import build_tiny_reward_model

    classifier = build_tiny_reward_model(tmp_path / "rm")
    wrong = _cfg("reward.combine={reverse_digits: {judge: 1.0}}", f"reward.judge.model={classifier}",
                 f"reward.judge.prompt_template={tmp_path / 'template.txt'}")  # fmt: skip
    ((field, message),) = {(f.field, f.message) for f in combine_findings(wrong, rows)}
    assert field == "reward.judge.model" and "holds a Qwen2ForSequenceClassification, not a causal LM" in message
    (role,) = reward_roles(good, good.samples_per_step)
    assert role["role"] == "LLM judge" and 0 < role["memory_gib"] < 0.1
    assert "a Ray actor of its own on any node Ray picks" in role["where"]  # not pinned to the controller's


def _rm_config(path: Path, **values) -> str:
    """A reward model's config.json alone (the plan reads nothing else of it)."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"], "hidden_size": 3584,
              "num_hidden_layers": 28, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
              "vocab_size": 152064, "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "num_labels": 1}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config | values))
    return str(path)


PPO7 = ROOT / "configs" / "qwen2.5_7b_ppo.yaml"
ROLE = ("reward.model.placement=disaggregated",)


def test_the_reward_model_role_takes_the_last_gpus_and_its_memory_is_planned(tmp_path):
    from rich.console import Console

    from megarl.plan.report import print_plan
    from megarl.plan.step_timeline import timeline_text

    rm = _rm_config(tmp_path / "rm")
    cfg = load_config(PPO7, [f"reward.model.path={rm}", *ROLE, "reward.model.gpus=4", "reward.model.max_length=4096"])
    plan = make_plan(cfg)
    assert plan.roles["policy"].gpus == (0, 1, 2, 3) and plan.roles["rollout"].gpus == (0, 1, 2, 3)
    assert plan.reward_model is not None and plan.reward_model.gpus == (4, 5, 6, 7)
    mem = plan.memory.reward_model
    # Qwen2.5-7B's 7.07B parameters without the LM head (7.62B with it), in bf16
    assert 7.06e9 < mem.weights / 2 < 7.08e9 and mem.tokens == (8, 4096)
    console = Console(record=True, width=300)
    print_plan(cfg, plan, console)
    text = console.export_text()
    assert "reward model: 4 actors of its own" in text
    assert f"step timeline {timeline_text(cfg)}" in " ".join(text.split())  # (the console wraps it)
    assert [f"reward_model actor {i} (a placement group of its own)" in text for i in range(4)] == [True] * 4
    assert f"reward model memory/GPU weights 13.2 (bfloat16) + activations {mem.activations / 2**30:.1f}" in text
    # disaggregated rollout: training pool, then the rollout pool, then the reward model's devices
    split = make_plan(load_config(PPO7, [f"reward.model.path={rm}", *ROLE, "reward.model.gpus=8", "cluster.nnodes=3",
                                         "cluster.placement=disaggregated", "cluster.rollout_gpus=8"]))  # fmt: skip
    assert (split.roles["policy"].gpus, split.roles["rollout"].gpus) == (tuple(range(8)), tuple(range(8, 16)))
    assert split.reward_model.gpus == tuple(range(16, 24))


@pytest.mark.parametrize(("overrides", "message"), [
    (("reward.model.gpus=4", "reward.model.batch_size=64"),
     "reward.model.batch_size: the reward model needs an estimated 360.2 GiB per GPU (weights 13.2 + activations of one batch "
     "of 64 x 32768 tokens 346.0 + runtime 1.0), 280.2 GiB over cluster.gpu_memory_gib (80); lower reward.model.batch_size "
     "or reward.model.max_length"),
    (("reward.model.gpus=8",), "reward.model.gpus: (8) leaves no device for training: the cluster has 8"),
    (("reward.model.gpus=2", "cluster.nnodes=2"), "reward.model.gpus: (2) is not a multiple of cluster.gpus_per_node (8): "
     "on a multi-node cluster the role must take whole nodes; use 8"),
    (("reward.model.gpus=2", "cluster.nnodes=3"), "reward.model.gpus: (2) is not a multiple of cluster.gpus_per_node (8): "
     "on a multi-node cluster the role must take whole nodes; use 8 or 16"),
    (("reward.model.gpus=4", "reward.model.device=cuda"), "reward.model.device: (cuda) is for placement workers"),
    (("reward.model.placement=colocated", "reward.model.gpus=2"),
     "reward.model.gpus: (2) is not used with reward.model.placement=colocated (one actor on each training device"),
    (("reward.model.placement=colocated", "rollout.max_staleness=1"),
     "reward.model.placement: (colocated) loads the reward model onto the training devices to score, which an asynchronous run"),
    (("reward.model.placement=colocated", "reward.model.batch_size=64"),
     # the reward model's 360.2 (as above) + SGLang's weights 7.1 + the trainer's and SGLang's runtime 4.5
     "reward.model: the training devices need an estimated 371.8 GiB per GPU in phase reward"),
    (("reward.model.gpus=4", "reward.model.max_length=40000"), "reward.model.max_length: (40000) is above the reward "
     "model's max_position_embeddings (32768, "),
])  # fmt: skip
def test_the_plan_refuses_a_reward_model_role_that_cannot_run(tmp_path, overrides, message):
    rm = _rm_config(tmp_path / "rm")
    with pytest.raises(PlanError) as info:
        make_plan(load_config(PPO7, [f"reward.model.path={rm}", *ROLE, *overrides]))
    assert message in str(info.value)


def test_an_in_process_run_refuses_the_role_and_a_cpu_plan_counts_processes(tmp_path):
    rm = _rm_config(tmp_path / "rm", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=100, max_position_embeddings=64, torch_dtype="float32")  # fmt: skip
    with pytest.raises(PlanError, match="is a Ray actor and --in-process runs without Ray"):
        make_plan(_cfg(f"reward.model.path={rm}", *ROLE, "cluster.gpus_per_node=1"), in_process=True)
    plan = make_plan(_cfg(f"reward.model.path={rm}", *ROLE, "actor.mini_batch_size=256"))
    assert plan.roles["policy"].gpus == (0,) and plan.reward_model.gpus == (1,)
    (role,) = reward_roles(_cfg(f"reward.model.path={rm}", *ROLE), 256)
    assert role["where"] == ("1 Ray actor of its own, one per process, on 1 process kept out of the training and "
                             "rollout pools (a placement group bundle each)") and role["per"] == "per process"
def _judge(path: Path, *extra: str) -> list[str]:
    """reward.judge on SGLang with a 7B causal LM's config.json (the plan reads nothing else of it)."""
    model = _rm_config(path, architectures=["Qwen2ForCausalLM"])
    return ["reward.combine={gsm8k: {gsm8k: 1.0, judge: 1.0}}", f"reward.judge.model={model}",
            "reward.judge.prompt_template=judge {prompt} {response}", "reward.judge.engine=sglang", *extra]  # fmt: skip


def test_an_sglang_judge_on_cuda_takes_the_last_gpus_and_its_memory_is_planned(tmp_path):
    """cluster.device cuda: reward.judge.gpus / tp servers on the cluster's last devices (after the
    reward model's), held in every phase; each rank's memory the planner's SGLang model: mem_fraction
    (0.8 unset) of the GPU less SGLang's context, the weights over tp, the KV cache the rest."""
    from megarl.plan.gpu_memory import GIB
    from megarl.plan.step_timeline import timeline_text

    cfg = load_config(PPO7, _judge(tmp_path / "judge", "reward.judge.gpus=4", "reward.judge.tp=2"))
    plan = make_plan(cfg)
    assert plan.roles["policy"].gpus == (0, 1, 2, 3) and plan.roles["rollout"].gpus == (0, 1, 2, 3)
    assert plan.judge is not None and (plan.judge.gpus, plan.judge.tp, plan.judge.dp) == ((4, 5, 6, 7), 2, 2)
    mem, arch = plan.memory.judge, plan.arch  # the judge's config.json is Qwen2.5-7B's shapes, as the policy's
    budget = 0.8 * (80 - 1.5) * GIB  # SGLang's CUDA context is out of what it sees free
    weights = arch.num_params * 2 / 2  # bf16, over tp 2
    kv_token = 2 * 28 * (4 // 2) * 128 * 2  # k and v, 28 layers, 2 of the 4 KV heads per rank, bf16
    assert (mem.server.budget, mem.server.weights) == pytest.approx((budget, weights))
    assert mem.server.full_length_sequences == int((budget - weights) // (kv_token * 32768)) and mem.context == 32768
    assert mem.total == pytest.approx(budget + 4.0 * GIB)  # + SGLang's context, graphs and allocator cache
    text = " ".join(_printed_plan(cfg, plan).split())
    assert "LLM judge: 2 x sglang server tp2 of its own" in text
    for k, gpu in enumerate((4, 5, 6, 7)):
        assert f"{gpu} │ judge server {k // 2} tp{k % 2} (SGLang, a placement group of its own) │ {mem.total / GIB:.1f}" in text
    assert f"judge memory/GPU {budget / GIB:.1f} GiB (reward.judge.mem_fraction 0.8 of the 78.5 GiB free at launch)" in text
    assert timeline_text(cfg).endswith("the LLM judge holds its 4 GPUs in every phase and works in reward only")
    assert "LLM judge in 2 SGLang servers on 4 GPUs of its own" in timeline_text(cfg)
    (role,) = reward_roles(cfg, cfg.samples_per_step)
    assert role["where"].startswith("2 SGLang servers of its own, tp 2, on 4 GPUs kept out of the other pools")
    # with a reward model's role too: its devices first, then the judge's
    both = make_plan(load_config(PPO7, [*_judge(tmp_path / "judge", "reward.judge.gpus=2"), f"reward.model.path={_rm_config(tmp_path / 'rm')}",
                                        *ROLE, "reward.model.gpus=2", "reward.combine={gsm8k: {model: 1.0, judge: 1.0}}"]))  # fmt: skip
    assert (both.roles["policy"].gpus, both.reward_model.gpus, both.judge.gpus) == ((0, 1, 2, 3), (4, 5), (6, 7))
    # on cpu its one server stays beside the controller: no devices of its own
    cpu = _cfg(*_judge(tmp_path / "judge"))
    assert make_plan(cpu).judge is None and reward_roles(cpu, 8)[0]["where"].startswith("SGLang server of its own")


@pytest.mark.parametrize(("overrides", "message"), [
    (("reward.judge.gpus=3", "reward.judge.tp=2"), "reward.judge.gpus: (3) must be a multiple of reward.judge.tp (2): one "
     "server per tp devices; set gpus to a multiple of 2, or tp to one of [1]"),
    (("reward.judge.gpus=8",), "reward.judge.gpus: (8) leaves no device for training: the cluster has 8 (nnodes x "
     "gpus_per_node); lower it or add devices"),
    (("reward.judge.gpus=2", "reward.model.placement=disaggregated", "reward.model.gpus=6"),
     "reward.judge.gpus: (2) leaves no device for training: the cluster has 8 (nnodes x gpus_per_node) and "
     "reward.model.gpus takes 6; lower it or add devices"),
    (("reward.judge.gpus=4", "cluster.nnodes=2", "cluster.placement=disaggregated", "cluster.rollout_gpus=8"),
     "reward.judge.gpus: (4): reward.judge.gpus + cluster.rollout_gpus = 12 is not a multiple of cluster.gpus_per_node (8): "
     "on a multi-node cluster the devices out of the training pool must be whole nodes; lower the others or add nodes"),
    (("reward.judge.gpus=4", "cluster.nnodes=3", "cluster.placement=disaggregated", "cluster.rollout_gpus=8"),
     "reward.judge.gpus: (4): reward.judge.gpus + cluster.rollout_gpus = 12 is not a multiple of cluster.gpus_per_node (8): "
     "on a multi-node cluster the devices out of the training pool must be whole nodes; use 8"),
    (("reward.judge.gpus=3", "reward.judge.tp=3"), "reward.judge.tp: (3) must divide cluster.gpus_per_node (8): a server's "
     "devices are on one node"),
    (("reward.judge.gpus=4", "reward.judge.mem_fraction=0.1"), "reward.judge.mem_fraction: (0.1) leaves 7.9 GiB per GPU, "
     "less than the judge's weights (14.2 GiB at reward.judge.tp=1); raise reward.judge.tp or mem_fraction"),
    (("reward.judge.gpus=4", "reward.judge.mem_fraction=0.99"), "reward.judge.mem_fraction: (0.99): a judge server needs an "
     "estimated 81.7 GiB per GPU (mem_fraction's 77.7 + SGLang's own 4.0 outside it), over cluster.gpu_memory_gib (80)"),
    ((), "rollout.tp: (2) must divide the 7 GPUs of the rollout pool (left after reward.judge.gpus (1)); try 1"),
    (("reward.judge.gpus=2", "reward.model.placement=disaggregated", "cluster.placement=disaggregated",
      "cluster.rollout_gpus=2"), "actor.parallel: tp x pp (2 x 1 = 2) must divide the 3 GPUs of the training pool (left after "
     "reward.model.gpus (1) and reward.judge.gpus (2) and cluster.rollout_gpus (2))"),
    (("reward.judge.gpus=4", "reward.judge.engine=torch"), "reward.judge.gpus: (4) is used with reward.judge.engine=sglang "
     "only (the torch engine runs on CPU); remove it or set the engine"),
])  # fmt: skip
def test_the_plan_refuses_an_sglang_judge_on_cuda_that_cannot_run(tmp_path, overrides, message):
    extra = [f"reward.model.path={_rm_config(tmp_path / 'rm')}"] if any("reward.model" in o for o in overrides) else []
    with pytest.raises(PlanError) as info:
        make_plan(load_config(PPO7, [*_judge(tmp_path / "judge"), *extra, *overrides]))
    assert message in str(info.value)


def test_the_judges_devices_are_refused_where_they_mean_nothing(tmp_path):
    """--in-process (no Ray to place its servers), and cluster.device cpu (its one server is the controller's child)."""
    cuda = load_config(PPO7, [*_judge(tmp_path / "judge", "reward.judge.gpus=1"), "cluster.gpus_per_node=1"])
    with pytest.raises(PlanError, match=r"reward.judge.engine: \(sglang\) on cluster.device cuda runs its servers on devices "
                       r"of their own, placed through Ray, and --in-process runs without Ray; use reward.judge.engine=torch"):  # fmt: skip
        make_plan(cuda, in_process=True)
    with pytest.raises(PlanError, match=r"reward.judge.tp: \(2\) is used on cluster.device cuda only \(on cpu the judge's "
                       r"one SGLang server is a child process of the controller\); remove it"):  # fmt: skip
        make_plan(_cfg(*_judge(tmp_path / "judge", "reward.judge.tp=2")))


@pytest.mark.parametrize("engine", ["sglang", "torch"])
def test_a_judge_context_length_above_the_models_positions_is_refused_on_cpu(tmp_path, engine):
    """SGLang refuses it at launch ("greater than the derived context_length"): the plan says so first."""
    judge = [*_judge(tmp_path / "judge"), f"reward.judge.engine={engine}"]
    with pytest.raises(PlanError) as info:
        make_plan(_cfg(*judge, "reward.judge.context_length=40000"))
    assert (f"reward.judge.context_length: (40000) is above the judge model's max_position_embeddings (32768, "
            f"{tmp_path / 'judge'}/config.json); lower it to 32768 or leave it null (the model's own)") in str(info.value)
    make_plan(_cfg(*judge, "reward.judge.context_length=32768"))


def test_the_reward_rows_size_a_model_as_the_planner_does_at_the_judges_own_context(tmp_path):
    """The judge's and the reward model's rows count a model from resolve_arch, as the planner
    counts the policy (here its experts, GQA with head_dim and q/k norms); the judge's KV cache at
    reward.judge.context_length, not the model's positions."""
    from megarl.config.architectures import resolve_arch

    moe = _rm_config(tmp_path / "moe", model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=1000,
                     max_position_embeddings=32768, torch_dtype="bfloat16")  # fmt: skip
    arch = resolve_arch(moe, None)
    judge = ["reward.combine={reverse_digits: {judge: 1.0}}", f"reward.judge.model={moe}",
             "reward.judge.prompt_template=judge {prompt} {response}", "reward.judge.context_length=512",
             "reward.judge.max_running_requests=4"]  # fmt: skip
    (role,) = reward_roles(_cfg(*judge), 8)
    kv = arch.num_layers * 2 * arch.num_kv_heads * 64 * 4 * 512 * 4  # k and v, fp32, 512 tokens x 4 sequences
    assert role["memory_gib"] * 2**30 == pytest.approx(arch.num_params * 2 + kv)
    (role,) = reward_roles(_cfg(*judge, "reward.judge.engine=sglang"), 8)  # its server's token pool: 4096 tokens
    assert role["memory_gib"] * 2**30 == pytest.approx(arch.num_params * 2 + kv * 4096 // (512 * 4))
    (role,) = reward_roles(_cfg(f"reward.model.path={moe}", "reward.workers=2"), 8)
    classifier = arch.num_params - arch.embedding_params + arch.hidden_size  # no LM head; a score head of 1 label
    assert role["memory_gib"] * 2**30 == pytest.approx(2 * classifier * 2)


def test_the_plan_shows_where_the_reward_roles_act_in_the_step(tmp_path):
    """The step timeline: generate, then reward (the rule workers, the reward model, the judge), then
    the training phases; a role on devices of its own holds them in every phase; asynchronous runs
    score in the producer, concurrently with training."""
    from megarl.plan.step_timeline import step_phases, timeline_text

    rm = _rm_config(tmp_path / "rm")
    judge = ["reward.combine={reverse_digits: {reverse_digits: 1.0, model: 0.5, judge: 1.0}}", f"reward.judge.model={rm}",
             "reward.judge.prompt_template=judge {prompt} {response}"]  # fmt: skip
    cfg = load_config(PPO7, [f"reward.model.path={rm}", *ROLE, "reward.model.gpus=4", *judge])
    phases = step_phases(cfg)
    assert [p for p, _ in phases] == ["generate", "reward", "policy_forward", "reference_forward", "critic_forward",
                                      "critic_update", "policy_update", "weight_push"]  # fmt: skip
    assert dict(phases)["reward"] == ("rule rewards in 2 reward workers, reward model 4 actors on 4 GPUs of its own, "
                                      "LLM judge in its torch engine")  # fmt: skip
    text = timeline_text(cfg)
    assert text.startswith("generate (SGLang engines on the training GPUs) -> reward (rule rewards")
    assert text.endswith("the reward model holds its 4 GPUs in every phase and works in reward only; the LLM judge's "
                         "torch engine keeps its weights in host memory in every phase and works in reward only")  # fmt: skip
    one = dict(step_phases(_cfg(f"reward.model.path={rm}", *ROLE)))["reward"]  # one process on cpu: singular
    assert "reward model 1 actor on 1 process of its own" in one
    workers = timeline_text(_cfg(f"reward.model.path={rm}"))  # placement workers: the model is in the reward workers
    assert "reward (reward model in the 2 reward workers on cpu) -> policy_update" in workers and "every phase" not in workers
    producer = timeline_text(_cfg("rollout.max_staleness=1"))
    assert producer.startswith("producer: generate (torch engine process of its own) -> reward (rule rewards in 2 reward "
                               "workers); concurrently, trainer: policy_forward")  # fmt: skip


def test_a_colocated_reward_model_is_on_every_training_gpu_and_counted_in_its_phase(tmp_path):
    """reward.model.placement colocated: one actor per policy GPU; its weights and one batch's
    activations in phase reward only, its runtime in every phase, its host copy in host memory."""
    from megarl.plan.gpu_memory import GIB

    rm = _rm_config(tmp_path / "rm")
    base = load_config(PPO7, [f"reward.model.path={rm}"])
    cfg = load_config(PPO7, [f"reward.model.path={rm}", "reward.model.placement=colocated", "reward.model.max_length=4096"])
    plan, without = make_plan(cfg), make_plan(base)
    assert plan.reward_model is not None and plan.reward_model.gpus == plan.roles["policy"].gpus == tuple(range(8))
    rm_mem, mem = plan.memory.reward_model, plan.memory
    assert rm_mem.runtime == 1.0 * GIB and rm_mem.tokens == (8, 4096)
    # every other phase: as without the reward model, plus its actor's runtime
    assert {p: b - rm_mem.runtime for p, b in mem.phases.items() if p != "reward"} == pytest.approx(without.memory.phases)
    # reward: the states a forward phase keeps (here: SGLang's weights; the models are offloaded) + the reward model
    resident = sum(b for s, b in mem.residency["reward"].items())
    assert set(mem.residency["reward"]) == {"reward_model/weights", "engine/weights"}
    overhead = without.memory.phases["policy_forward"] - sum(without.memory.residency["policy_forward"].values()) - mem.policy.logits
    assert mem.phases["reward"] == pytest.approx(resident + rm_mem.activations + overhead + rm_mem.runtime)
    assert mem.residency["reward"]["reward_model/weights"] == rm_mem.weights
    assert mem.host.offloaded["reward_model"] == pytest.approx(8 * rm_mem.weights)  # one host copy per actor on the node
    text = " ".join(_printed_plan(cfg, plan).split())
    assert "reward model: 8 actors on the training devices" in text
    assert text.count("(on the device in phase reward only)") == 8
    assert "reward (reward model one actor on each training GPU, loaded onto it for this phase only) -> policy_forward" in text
    assert f"reward {mem.phases['reward'] / GIB:.1f}, policy_forward" in text


def _printed_plan(cfg, plan) -> str:
    from rich.console import Console

    from megarl.plan.report import print_plan

    console = Console(record=True, width=300)
    print_plan(cfg, plan, console)
    return console.export_text()


def test_reward_model_device_can_be_unset_from_the_command_line(tmp_path):
    """A config file's reward.model.device, unset for a role (which runs on cluster.device) with
    `reward.model.device=null`; in the workers null is cpu."""
    rm = _rm_config(tmp_path / "rm")
    make_plan(load_config(PPO7, [f"reward.model.path={rm}", *ROLE, "reward.model.gpus=4", "reward.model.device=null"]))
    cfg = _cfg(f"reward.model.path={rm}", "reward.model.device=null")
    (role,) = reward_roles(cfg, 8)
    assert role["where"].endswith("reward worker processes on cpu")
