"""The mixture-of-experts demo config (configs/tiny_moe_grpo.yaml: a tiny Qwen3-MoE, experts split
over the 2 policy processes, EP=2) through Ray with the torch engine: the experts' pushes reach
the engine exactly, the held-out reward rises, and a resume from a checkpoint goes on where the
run was (the optimizer is a chain of two: dense and expert parameters), and the replay metrics
are reported; the DeepSeek-V3 demo config (configs/tiny_dsv3_grpo.yaml: multi-latent attention, a
shared expert, grouped sigmoid routing with a correction bias) trains a few steps with its routing
replayed."""

from __future__ import annotations

import math
import shutil

import pytest
from run_helpers import ROOT, read_jsonl

from megarl.commands.demo import prepare_demo

pytestmark = pytest.mark.slow

MOE = ROOT / "configs" / "tiny_moe_grpo.yaml"
DSV3 = ROOT / "configs" / "tiny_dsv3_grpo.yaml"


def _run(root, out, steps: int, *extra: str, config=MOE) -> list[dict]:
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.launch import run

    model, data = prepare_demo(root, arch=load_config(config).model.arch)
    cfg = load_config(config, [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
                            f"data.val_files=[{data / 'val.parquet'}]", f"trainer.output_dir={out}",
                            f"trainer.total_steps={steps}", "trainer.loggers=[jsonl]",
                            "rollout.weight_sync.check_logprobs_every=1", *extra])  # fmt: skip
    run(cfg, make_plan(cfg, check_files=True))
    return read_jsonl(out / "metrics.jsonl")


def test_moe_demo_learns_with_expert_parallelism_and_resumes_exactly(ray_local, tmp_path_factory):
    root, out = tmp_path_factory.mktemp("moe-demo"), tmp_path_factory.mktemp("moe-run")
    # fully_reshardable: megarl loads each optimizer of the chain itself (dp_reshardable: Megatron's chain does)
    layout = ("trainer.eval_freq=40", "trainer.save_freq=20", "actor.optimizer.checkpoint_format=fully_reshardable")
    records = _run(root, out, 40, *layout)
    val = {r["step"]: r["val/reward/mean"] for r in records if "val/reward/mean" in r}
    assert val[40] > val[0] + 0.1, val  # measured 0.06 -> 0.40 over 40 steps
    trained = [r for r in records if "reward/mean" in r]
    assert max(r["weight_sync/logprob_diff"] for r in trained) < 1e-4  # every expert reached the engine exactly
    assert max(r["rollout/logprob_mismatch"] for r in trained) < 1e-4
    # routing replay (the config's experts): measured at the first update and every 10th
    assert [r["step"] for r in trained if "actor/moe/routing_agreement" in r] == [1, 11, 21, 31]
    assert all(r["actor/moe/routing_agreement"] > 0.99 for r in trained if "actor/moe/routing_agreement" in r)
    # From a copy of step 20's checkpoint, steps 21-40 again: the same updates (the expert
    # optimizer's state included), so the same metrics.
    again = tmp_path_factory.mktemp("moe-resume")
    shutil.copytree(out / "checkpoints" / "step_000020", again / "checkpoints" / "step_000020")
    # (metrics.jsonl's records up to step 20 come back from the checkpoint's copy of it)
    resumed = _run(root, again, 40, *layout, "trainer.resume=auto")
    assert [r["step"] for r in resumed if "reward/mean" in r] == list(range(1, 41))
    assert {r["step"]: _comparable(r) for r in resumed} == {r["step"]: _comparable(r) for r in records}


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "weight_sync/seconds", "weight_sync/gbps"))}


def test_deepseek_v3_demo_trains_with_routing_replay(ray_local, tmp_path_factory):
    """A few GRPO steps of the DeepSeek-V3 demo (EP=2, routing_replay experts): each step logged
    once, a finite loss, every push reaching the engine exactly, the replay measured."""
    root, out = tmp_path_factory.mktemp("dsv3-demo"), tmp_path_factory.mktemp("dsv3-run")
    small = ("data.prompts_per_step=8", "actor.mini_batch_size=64", "actor.micro_batch_size=32",
             "trainer.eval_before_train=false",
             "trainer.save_freq=0")  # fmt: skip
    records = _run(root, out, 3, *small, config=DSV3)
    trained = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(math.isfinite(r["actor/loss"]) for r in trained), [r["actor/loss"] for r in trained]
    assert max(r["weight_sync/logprob_diff"] for r in trained) < 1e-4  # MLA, shared and routed experts pushed exactly
    assert max(r["rollout/logprob_mismatch"] for r in trained) < 1e-4
    first = trained[0]  # replay measured at the first update: both MoE layers (1 and 2; layer 0 is dense)
    assert {k for k in first if k.startswith("actor/moe/routing_agreement/")} == {
        "actor/moe/routing_agreement/layer1", "actor/moe/routing_agreement/layer2"}
    assert first["actor/moe/routing_agreement"] > 0.99, first
    assert first["actor/moe/logprob_diff_replay"] < 1e-4, first
