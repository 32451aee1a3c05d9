"""Conversion in both directions through the real command paths (Ray groups of CPU ranks):

- HF -> Megatron(TP=2, PP=2) -> HF reproduces every tensor bit for bit (names, dtypes, values)
  for Qwen2 (QKV bias, untied output layer) and Llama (tied embeddings). Qwen2 goes back with
  TP=1, PP=1 (resharding on load, and a vocabulary padded differently: 259 rows are 260 at
  TP=2); Llama with the recorded layout through the short form `megarl convert CKPT OUT`, in
  bf16 from an fp32 model (every tensor is the original cast to bf16, and config.json says
  bfloat16: transformers loads the written model in the dtype it was written in);
- `megarl launch` trains from a model checkpoint written with another layout than the run's
  (TP=2 -> the demo's TP=1 x DP=2), PPO with a critic: the torch engines start from random
  weights and get the trainer's initial push (engine and trainer log-probs agree), the
  reference starts from the same weights (KL 0 at the first step), and the critic's trunk
  comes from the checkpoint too (critic.path defaults to model.path; its value head, which a
  policy checkpoint does not hold, keeps its initialisation);
- without Ray (--in-process, one rank in the command's own process): HF -> model checkpoint ->
  HF bit for bit, a training checkpoint's export equal to the Ray export's files, and
  `megarl generate --in-process` from it equal to generating from those files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from run_helpers import TINY, small_overrides, train

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _assert_same_tensors(original, converted, dtype: torch.dtype | None = None) -> None:
    a, b = _tensors(original), _tensors(converted)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    a = {name: t.to(dtype or t.dtype) for name, t in a.items()}
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("arch,extra,back,dtype", [
    ("qwen2", {}, (1, 1), "float32"),
    ("llama", {"tie_word_embeddings": True}, None, "bfloat16"),
], ids=["qwen2", "llama"])  # fmt: skip
def test_hf_to_megatron_tp2_pp2_and_back_bit_for_bit(ray_local, tmp_path, arch, extra, back, dtype):
    from megarl.checkpoint.model_checkpoint import RECORD, check_model_checkpoint
    from megarl.commands.conversion import convert_hf_to_megatron, export_model_checkpoint
    from megarl.models.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / arch, arch, **SHAPE, **extra)
    config = json.loads((hf / "config.json").read_text())
    assert ("q_proj.bias" in str(_tensors(hf).keys())) == (arch == "qwen2")
    assert ("lm_head.weight" in _tensors(hf)) == (arch == "qwen2")
    ckpt = convert_hf_to_megatron(hf, tmp_path / "ckpt", tp=2, pp=2, dtype=None if dtype == "float32" else dtype)
    record = check_model_checkpoint(ckpt)
    assert (record["tp"], record["pp"], record["dtype"]) == (2, 2, dtype)
    assert record["hf_config"] == config
    # Megatron's parameters, each once at TP=2 x PP=2: per layer qkv (+ its fused norm), proj, fc1 (+ norm),
    # fc2, and qwen2's qkv bias; then embedding, final norm, and an output layer unless tied (its PP copy
    # on the last stage is the embedding)
    assert record["verified_parameters"] == SHAPE["num_layers"] * (7 if arch == "qwen2" else 6) + (3 if arch == "qwen2" else 2)
    assert (ckpt / "tokenizer.json").is_file() and not list(ckpt.glob("*.safetensors"))
    assert sorted(json.loads((ckpt / RECORD).read_text())["files"]) == sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != RECORD
    )
    out = tmp_path / "hf_again"
    if back is None:  # the short form, with the recorded layout
        done = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", str(ckpt), str(out)],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "(TP=2, PP=2)" in done.stdout and "bit for bit" in done.stdout
    else:
        export_model_checkpoint(ckpt, out, *back)
        # without Ray: one rank, whatever the layout the checkpoint was saved in (no --tp/--pp given,
        # as `megarl generate --in-process` exports it)
        said = _without_ray("convert", ckpt, tmp_path / "in_process", "--in-process")
        assert "(TP=1, PP=1)" in said
        _assert_same_tensors(hf, tmp_path / "in_process", getattr(torch, dtype))
    _assert_same_tensors(hf, out, getattr(torch, dtype))
    # each parameter counted once, whatever the layout (TP shards were counted per rank: 2x)
    assert json.loads((out / "megarl_export.json").read_text())["verified_parameters"] == record["verified_parameters"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text()) == {**config, "dtype": dtype}  # the written tensors'


def test_launch_trains_from_a_model_checkpoint(ray_local, demo_root, tmp_path):
    from megarl.commands.conversion import convert_hf_to_megatron
    from megarl.commands.demo import prepare_demo

    model, _ = prepare_demo(demo_root)
    ckpt = convert_hf_to_megatron(model, tmp_path / "demo_tp2", tp=2, pp=1)
    _, _, records = train(demo_root, tmp_path / "run", 2, f"model.path={ckpt}", "algorithm.estimator=gae",
                          "critic.mini_batch_size=32", "critic.micro_batch_size=16")
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert first["weight_sync/logprob_diff"] < 1e-4  # the engines hold the checkpoint's weights
    assert first["rollout/logprob_mismatch"] < 1e-4
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # reference == policy at the start
    assert all(math.isfinite(r["critic/loss"]) for r in records)


# `megarl ...` in a process where Ray cannot be imported (a one-GPU box without it): None in
# sys.modules makes every `import ray` fail, as there.
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from megarl.cli import main; sys.exit(main(sys.argv[1:]))"


def _without_ray(*args) -> str:
    done = subprocess.run([sys.executable, "-c", WITHOUT_RAY, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_in_process_conversions_and_generation_need_no_ray_and_equal_rays(ray_local, demo_root, tmp_path):
    # Without Ray: HF -> model checkpoint -> HF (--in-process both ways) reproduces the model bit
    # for bit; an RL run's training checkpoint (--in-process, one rank) exports to the same files
    # as the Ray export, and generate --in-process from it equals generating from that export.
    import pyarrow.parquet as pq

    from megarl.commands.conversion import convert_checkpoint
    from megarl.commands.demo import prepare_demo
    from megarl.commands.generate import generate

    model, data = prepare_demo(demo_root)
    _without_ray("convert", "hf-to-megatron", "--hf", model, "--out", tmp_path / "ckpt", "--in-process")
    out = _without_ray("convert", tmp_path / "ckpt", tmp_path / "back", "--in-process")
    assert "into 1 rank(s) in this process" in out
    _assert_same_tensors(model, tmp_path / "back")

    run = small_overrides(demo_root, tmp_path / "run", 1, "cluster.gpus_per_node=1", "trainer.save_freq=1")
    _without_ray("launch", TINY, "--in-process", *run)
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    _without_ray("convert", step, tmp_path / "in_process", "--in-process")
    convert_checkpoint(step, tmp_path / "ray")  # this process has Ray
    _assert_same_tensors(tmp_path / "ray", tmp_path / "in_process")

    greedy = ["rollout.n=1", "rollout.sampling.temperature=0", "rollout.sampling.max_new_tokens=4"]
    _without_ray("generate", TINY, *greedy, "--model", step, "--data", data / "val.parquet", "--out", tmp_path / "a.parquet",
                 "--in-process")  # fmt: skip
    generate(TINY, greedy, data / "val.parquet", tmp_path / "b.parquet", model=str(tmp_path / "ray"))
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
