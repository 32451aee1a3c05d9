"""The planner's messages about mixture-of-experts runs: one line for a wrong ep with the choices
that tile tp x dp, an over-memory critic named as the critic with its ep to raise, the weight
push's links on CPU, and the convert summary's expert layout."""

from pathlib import Path

import pytest
from rich.console import Console

from megarl.commands.conversion import _parallel_text
from megarl.config.loading import load_config
from megarl.config.train_sections import ParallelConfig
from megarl.models.tiny import build_tiny_model
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.report import print_plan

CONFIGS = Path(__file__).parents[3] / "configs"
MOE30 = CONFIGS / "qwen3_30b_a3b_grpo.yaml"  # 4 x 8 GPUs, tp 2: tp x dp = 32, 128 experts
TINY_MOE = CONFIGS / "tiny_moe_grpo.yaml"


def _issues(path, *overrides, check_files=False) -> list:
    with pytest.raises(PlanError) as info:
        make_plan(load_config(path, list(overrides)), check_files=check_files)
    return info.value.issues


def test_a_wrong_ep_is_one_line_with_the_choices_that_tile_tp_x_dp(tmp_path):
    model = build_tiny_model(tmp_path / "m", "qwen3_moe")  # 4 experts; 2 CPU processes at tp 1: tp x dp = 2
    issues = _issues(TINY_MOE, f"model.path={model}", "actor.parallel.ep=4", f"trainer.output_dir={tmp_path / 'run'}",
                     check_files=True)  # fmt: skip
    about_ep = [i for i in issues if i.field in ("actor.parallel.ep", "model.path")]
    assert [i.field for i in about_ep] == ["actor.parallel.ep"]  # the bridge's own check adds no second line
    assert about_ep[0].message.endswith("try 1 or 2")  # 4 divides the experts, not tp x dp


def test_an_etp_that_fits_no_ep_names_the_etps_that_do():
    """etp 5 at ep 4 on tp x dp = 32: no ep tiles 32 at etp 5 (no "try none"): the etps that do at ep 4."""
    issues = [str(i) for i in _issues(MOE30, "actor.parallel.etp=5", "actor.parallel.ep=4") if i.field.startswith("actor.parallel")]
    assert issues == [
        "actor.parallel.etp: (5) must divide moe_intermediate_size (768): expert tensor parallelism splits each expert's "
        "gate/up rows and down columns; try 1, 2, 4 or 8 (at ep 4)",
        "actor.parallel.ep: (4) must divide num_experts (128) and, times etp (5), tp x dp (2 x 16 = 32): the expert-parallel "
        "groups lie across the tensor- and data-parallel ranks; try etp 1, 2, 4 or 8 (at ep 4)"]


def test_an_over_memory_critic_is_named_with_its_ep_to_raise():
    issues = _issues(MOE30, "algorithm.estimator=gae", "critic.parallel.tp=2", "critic.parallel.etp=2")
    (over,) = [i for i in issues if "training needs an estimated" in i.message]
    # the critic's whole experts (ep 1) take the policy's update over budget: the critic is to shrink
    assert over.field == "critic"
    assert "raise critic.parallel.ep to 2, 4, 8 or 16" in over.message  # divisors of 128 whose ep x etp 2 tiles 32
    assert "actor.parallel" not in over.message


def test_the_push_on_cpu_names_gloo_not_nvlink():
    cfg = load_config(TINY_MOE, [])
    console = Console(record=True, width=400)
    print_plan(cfg, make_plan(cfg), console)
    text = console.export_text()
    assert "received per process: EP gather" in text and "(gloo within the node)" in text
    assert "nvlink" not in text


def test_convert_summary_names_expert_parallelism():
    assert _parallel_text(ParallelConfig(tp=2, pp=1, ep=4, etp=2)) == "TP=2, PP=1, EP=4, ETP=2"
    assert _parallel_text(ParallelConfig(tp=2, pp=2)) == "TP=2, PP=2"


@pytest.mark.parametrize("mcore", ["0.16.1", "0.19.2"])
def test_aux_losses_at_tp_above_1_plan_on_every_supported_megatron_core(monkeypatch, mcore):
    """They train one rank's gradients at TP 2 on both (tests/distributed/test_moe_balance.py)."""
    import megarl.parallel.mcore_version as mcore_version

    monkeypatch.setattr(mcore_version, "installed_version", lambda: mcore)
    cfg = load_config(MOE30, ["actor.moe.aux_loss_coef=0.001", "actor.moe.z_loss_coef=0.001"])  # tp 2
    assert not [i for i in _plan_issues(cfg) if i.field.startswith("actor.moe.")]


def _plan_issues(cfg) -> list:
    try:
        make_plan(cfg)
    except PlanError as e:
        return e.issues
    return []

