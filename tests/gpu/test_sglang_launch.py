"""`megarl launch` with rollout.engine=sglang on one GPU: two GRPO steps on a tiny model,
colocated (SGLang releases its memory while the policy trains, the policy offloads while
SGLang generates), weights pushed over CUDA IPC and checked by log-probs after every push.

Skipped unless CUDA, sglang and ray are importable. NOT yet run: written on a machine without a
GPU (see docs/sglang.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or any(importlib.util.find_spec(m) is None for m in ("sglang", "ray")),
        reason="needs a CUDA GPU, sglang and ray installed (the launch places its workers with Ray)",
    ),
]


def test_launch_two_grpo_steps_with_sglang(tmp_path):
    from megarl.data.tasks import write_reverse_digits
    from megarl.models.tiny import build_tiny_model
    from megarl.trainer.launch import launch

    # head_dim 64 (hidden 256 / 4 heads): what SGLang's attention kernels support everywhere.
    model = build_tiny_model(tmp_path / "model", "qwen2", task_vocab="0123456789", dtype="bfloat16", hidden_size=256,
                             num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512, max_position_embeddings=256)  # fmt: skip
    data = tmp_path / "data"
    write_reverse_digits(data, seed=0)
    out = tmp_path / "run"
    overrides = [
        f"model.path={model}", "model.arch=null", "model.dtype=bfloat16",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
        "cluster.device=cuda", "cluster.gpus_per_node=1", "cluster.placement=colocated",
        "rollout.engine=sglang", "rollout.tp=1", "rollout.mem_fraction=0.3", "rollout.max_running_requests=64",
        "rollout.weight_sync.check_logprobs=true", "rollout.weight_sync.max_logprob_diff=0.05",
        "rollout.weight_sync.check_logprobs_every=1",
        "actor.offload=true", "data.prompts_per_step=8", "rollout.n=4",
        "actor.mini_batch_size=32", "actor.micro_batch_size=16",
        f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.eval_before_train=false",
        "trainer.eval_freq=2", "trainer.save_freq=0", "trainer.loggers=[jsonl]",
    ]  # fmt: skip
    last = launch(Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml", overrides)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/grad_norm"])
        assert r["response_length/mean"] > 0
        # The push reached the engine and the engine scores like the trainer (bf16 tolerance).
        assert r["weight_sync/logprob_diff"] <= 0.05
    assert "val/reward/mean" in last
    # Each engine wrote its server log under the run's logs.
    assert (out / "logs" / "sglang_engine0.log").is_file()
