"""The planner's checks of asynchronous training (megarl/plan/async_checks.py): where the
engines may generate while the policy trains, and what the plan report says generates."""

from pathlib import Path

import pytest
from rich.console import Console

from megarl.config.loading import load_config
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.report import print_plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY = CONFIGS / "tiny_grpo.yaml"
PPO7 = CONFIGS / "qwen2.5_7b_ppo.yaml"
GRPO72 = CONFIGS / "qwen72b_grpo.yaml"
TINY_MOE = CONFIGS / "tiny_moe_grpo.yaml"
# The demo's placement of SGLang on CPU: one server in a pool of its own beside the 2 policy ranks.
SGLANG_CPU = ("rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3", "cluster.rollout_gpus=1")
# SGLang on GPUs of their own: 8 policy GPUs, 8 rollout GPUs (4 servers of TP 2).
SGLANG_GPU = ("cluster.placement=disaggregated", "cluster.nnodes=2", "cluster.rollout_gpus=8")


def _report(path: Path, *overrides: str) -> str:
    cfg = load_config(path, list(overrides))
    console = Console(record=True, width=400)
    print_plan(cfg, make_plan(cfg), console)
    return console.export_text()


def refused(path: Path, *overrides: str) -> str:
    with pytest.raises(PlanError) as info:
        make_plan(load_config(path, list(overrides)))
    return str(info.value)


def test_sglang_on_cpu_generates_asynchronously_beside_the_policy():
    text = _report(TINY, *SGLANG_CPU, "rollout.max_staleness=1")
    assert "asynchronous max_staleness 1: 1 SGLang server generates while the policy ranks train" in text
    assert "partial rollouts (a push pauses the requests in flight)" in text


def test_sglang_on_gpus_of_their_own_generates_asynchronously():
    text = _report(PPO7, *SGLANG_GPU, "rollout.max_staleness=2")
    assert "asynchronous max_staleness 2: 4 SGLang servers generate while the policy ranks train" in text


def test_the_torch_engine_process_is_still_what_generates_on_cpu():
    assert "1 torch engine process generates" in _report(TINY, "rollout.max_staleness=1")


def test_colocated_sglang_on_cuda_is_refused_naming_the_placement():
    err = refused(GRPO72, "rollout.max_staleness=1")
    assert "rollout.max_staleness: (1) generates while the policy trains" in err
    assert "set cluster.placement=disaggregated and cluster.rollout_gpus" in err


def test_the_torch_engine_on_cuda_is_refused():
    err = refused(PPO7, *SGLANG_GPU, "rollout.engine=torch", "rollout.max_staleness=1")
    assert "runs the torch engine on CPU only" in err and "use rollout.engine=sglang" in err


def test_sglang_pushes_that_wait_for_the_requests_in_flight_are_refused():
    err = refused(TINY, *SGLANG_CPU, "rollout.max_staleness=1", "rollout.partial=false")
    assert "rollout.partial: (false) is not supported with asynchronous SGLang engines" in err
    assert "set rollout.partial=true or leave it out" in err
    make_plan(load_config(TINY, ["rollout.max_staleness=1", "rollout.partial=false"]))  # the torch engine waits


def test_what_asynchronous_training_cannot_do_yet_names_the_staleness_key():
    # an issue about another key named the staleness as a bare value: "... with asynchronous training yet (1)"
    err = refused(TINY_MOE, "rollout.max_staleness=1", "actor.moe.routing_replay=experts")
    assert ("actor.moe.routing_replay: (experts) is not supported yet with asynchronous training (rollout.max_staleness=1): "
            "a retracted or concurrent request's routing is not recorded whole") in err  # fmt: skip
    err = refused(TINY, "rollout.max_staleness=2", "algorithm.estimator=remax")
    assert "which an asynchronous sample (rollout.max_staleness=2) was not generated with; use grpo" in err


def test_sglang_engines_take_their_own_transports_asynchronously():
    make_plan(load_config(TINY, [*SGLANG_CPU, "rollout.max_staleness=1", "rollout.weight_sync.transport=disk"]))
    make_plan(load_config(PPO7, [*SGLANG_GPU, "rollout.max_staleness=1", "rollout.weight_sync.transport=distributed"]))
    err = refused(TINY, "rollout.max_staleness=1", "rollout.weight_sync.transport=in_process")
    assert "cannot reach an engine process of its own" in err  # the torch engine's process


@pytest.mark.parametrize("knob", ["tis", "mis"])
@pytest.mark.parametrize("staleness", ["0", "1"])
def test_tis_or_mis_with_the_engines_log_probs_as_old_is_refused(knob, staleness):
    # their weight is old / engine, 1 for every token when the old log-probs are the engine's
    err = refused(TINY, "algorithm.old_logprobs=engine", f"algorithm.{knob}.level=token", f"rollout.max_staleness={staleness}")
    assert f"algorithm.{knob}.level: (token) weighs by old / engine log-probs, which is 1 with algorithm.old_logprobs=engine" in err
    assert f"set algorithm.{knob}.level=none or algorithm.old_logprobs=recompute" in err


def test_the_plan_report_says_where_the_old_log_probs_come_from():
    assert "old log-probs recomputed" in _report(TINY, "rollout.max_staleness=1")
    text = _report(TINY, "rollout.max_staleness=1", "algorithm.old_logprobs=engine")
    assert "the engines' log-probs are the old ones" in text and "recomputed" not in text
