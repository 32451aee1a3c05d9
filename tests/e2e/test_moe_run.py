"""The mixture-of-experts demo config (configs/tiny_moe_grpo.yaml: a tiny Qwen3-MoE, experts split
over the 2 policy processes, EP=2) through Ray with the torch engine: the experts' pushes reach
the engine exactly, the held-out reward rises, and a resume from a checkpoint goes on where the
run was (the optimizer is a chain of two: dense and expert parameters), and the replay metrics
are reported."""

from __future__ import annotations

import shutil

import pytest
from run_helpers import ROOT, read_jsonl

from megarl.commands.demo import prepare_demo

pytestmark = pytest.mark.slow

MOE = ROOT / "configs" / "tiny_moe_grpo.yaml"


def _run(root, out, steps: int, *extra: str) -> list[dict]:
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.launch import run

    model, data = prepare_demo(root, arch="tiny-moe-demo")
    cfg = load_config(MOE, [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
                            f"data.val_files=[{data / 'val.parquet'}]", f"trainer.output_dir={out}",
                            f"trainer.total_steps={steps}", "trainer.loggers=[jsonl]", *extra])  # fmt: skip
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
    resumed = _run(root, again, 40, *layout, "trainer.resume=auto")
    assert [r["step"] for r in resumed if "reward/mean" in r] == list(range(21, 41))
    expected = {r["step"]: _comparable(r) for r in records if r["step"] > 20}
    assert {r["step"]: _comparable(r) for r in resumed} == expected


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "weight_sync/seconds", "weight_sync/gbps"))}
