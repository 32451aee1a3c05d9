"""Short real runs through Ray: GRPO (with profiling, conversion to HF), validation only, PPO with
a critic in its own worker group. One embedded Ray session for the whole module. The algorithm
variants (ReMax, DAPO, adaptive KL, critic warm-up) run without Ray, in
tests/distributed/test_in_process_trainer.py."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from run_helpers import REQUIRED_METRICS, TINY, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grpo_run(ray_local, demo_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    cfg, last, records = train(demo_root, out, 3, "trainer.profile_steps=[2]")
    return out, cfg, last, records


def test_grpo_three_steps(grpo_run):
    out, cfg, last, records = grpo_run
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        missing = [k for k in REQUIRED_METRICS if k not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["reward/errors"] == 0
        assert 0 <= record["reward/mean"] <= 1
        assert record["weight_sync/logprob_diff"] < 1e-4  # engine == trainer after each push
        assert record["rollout/logprob_mismatch"] < 1e-4
    assert "val/reward/mean" in records[-1]
    # The training files' counts go to the sinks once, with the first step's metrics.
    assert records[0]["data/train_prompts"] > 0 and records[0]["data/train_dropped_overlong"] == 0
    assert not any(k.startswith("data/train_") for r in records[1:] for k in r)
    # KL to the reference (k3 in the loss, from the demo config): zero before the first update,
    # positive once the policy has moved.
    assert records[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6) and records[-1]["actor/kl"] > 0
    assert (out / "checkpoints" / "step_000003" / "manifest.json").is_file()
    assert "total_steps: 3" in (out / "checkpoints" / "step_000003" / "config.yaml").read_text()
    assert list((out / "samples").glob("step_*.jsonl"))
    assert math.isfinite(last["actor/param_checksum"])
    profile = out / "profile"
    assert (profile / "step_2" / "policy_rank0.json").stat().st_size > 0  # torch profiler trace
    assert (profile / "ray_timeline.json").stat().st_size > 0


def test_convert_checkpoint_to_hf(grpo_run, demo_root, tmp_path):
    """The export re-imports bit for bit (checked inside convert); the result is a loadable HF
    directory holding the trained weights, not the initial ones."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.verification import CheckpointError
    from megarl.commands.conversion import convert_checkpoint
    from megarl.commands.generate import generate
    from megarl.commands.outputs import OutputError

    out, cfg, _, _ = grpo_run
    hf = convert_checkpoint(out / "checkpoints" / "step_000003", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(hf)
    initial = load_file(str(demo_root / "model" / "model.safetensors"))
    trained = dict(model.named_parameters())
    assert set(initial) == set(trained)
    assert any(not torch.equal(initial[k], trained[k].detach()) for k in initial)
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_checkpoint(out / "checkpoints" / "step_000003", hf)
    # the checkpoint keeps model.path's config.json as trained; one edited since is refused before Ray starts
    ckpt = out / "checkpoints" / "step_000003"
    assert (ckpt / "model_config.json").read_bytes() == (demo_root / "model" / "config.json").read_bytes()
    edited = shutil.copytree(demo_root / "model", tmp_path / "edited")
    (edited / "config.json").write_text((edited / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 5.0'))
    (tmp_path / "run.yaml").write_text((ckpt / "config.yaml").read_text().replace(str(demo_root / "model"), str(edited)))
    with pytest.raises(OutputError, match="config.json differs from the one step_000003 was trained with .rope_parameters"):
        convert_checkpoint(ckpt, tmp_path / "hf3", config=tmp_path / "run.yaml")
    # a GPU run's checkpoint exported on a machine without GPUs: one line saying where it can run
    (tmp_path / "gpu.yaml").write_text((ckpt / "config.yaml").read_text().replace("device: cpu", "device: cuda"))
    kept = set(Path(tempfile.gettempdir()).glob("megarl-convert-logs-*"))
    with pytest.raises(OutputError, match="^placement: 2 GPUs requested for policy, cluster has 0; step_000003 is exported "
                                          r"in the run's policy layout \(2 ranks, 1 GPU each\): run megarl convert where"):  # fmt: skip
        convert_checkpoint(ckpt, tmp_path / "hf4", config=tmp_path / "gpu.yaml")
    assert not (tmp_path / "hf4").exists()
    assert set(Path(tempfile.gettempdir()).glob("megarl-convert-logs-*")) == kept  # no rank started: no log folder left
    # without Ray (--in-process) only a layout of one rank converts: this run's has two
    refused = (r"^--in-process converts with one rank, in this process; step_000003's layout \(the run's policy\) has 2 "
               r"ranks: run it without --in-process \(Ray starts them\)$")  # fmt: skip
    with pytest.raises(OutputError, match=refused):
        convert_checkpoint(ckpt, tmp_path / "hf5", in_process=True)
    assert not (tmp_path / "hf5").exists()
    with pytest.raises(OutputError, match=refused):  # generate checks it before anything is written
        generate(TINY, [f"model.path={demo_root / 'model'}"], demo_root / "data" / "val.parquet", tmp_path / "gen.parquet",
                 model=str(ckpt), in_process=True)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("gen")) == []
    torn = tmp_path / "step_000003"
    shutil.copytree(out / "checkpoints" / "step_000003", torn)
    (torn / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        convert_checkpoint(torn, tmp_path / "hf2")


def test_validation_only(ray_local, demo_root, tmp_path):
    _, _, records = train(demo_root, tmp_path / "val", 3, "trainer.val_only=true")
    assert len(records) == 1 and records[0]["step"] == 0
    assert 0 <= records[0]["val/reward/mean"] <= 1 and "reward/mean" not in records[0]
    assert records[0]["data/train_prompts"] > 0  # logged with the first (here the only) metrics


def test_ppo_with_critic_two_steps(ray_local, demo_root, tmp_path):
    _, _, records = train(demo_root, tmp_path / "ppo", 2, "algorithm.estimator=gae", "algorithm.lam=0.95",
                          "critic.mini_batch_size=32", "critic.micro_batch_size=16", "critic.optimizer.lr=1e-3",
                          "actor.ppo_epochs=2", "algorithm.kl.use_in_reward=true")
    for record in records:
        assert "critic/loss" in record and math.isfinite(record["critic/loss"])
        assert record["time/values_s"] > 0 and record["time/old_logprobs_s"] > 0  # off-policy: 2 epochs
        assert "reward/kl" in record and record["actor/optimizer_steps"] == 2
