"""reward.judge.engine sglang on cluster.device cuda: the judge's SGLang server started on a GPU of
its own through Ray (a placement group, a host actor on its node: megarl/rollout/judge_server.py
start_judge_servers), scoring a few samples, then stopped with its placement released.

The judge is a tiny random model whose vocabulary is digits, so the number parser reads a score
from whatever it says: every sample is judged, none times out, and some output parses (bf16 on the
GPU is not compared with the CPU torch judge: greedy choices may differ between the two).

Skipped unless CUDA, sglang and ray are importable. NOT yet run: written on a machine without a
GPU (docs/reward-models.md).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(
        not torch.cuda.is_available() or any(importlib.util.find_spec(m) is None for m in ("sglang", "ray")),
        reason="needs a CUDA GPU, sglang and ray installed (the judge's server is placed with Ray)",
    ),
]

PROMPTS, RESPONSES = ["123", "456", "789", "120"], ["321", "654", "000", "021"]


def test_a_tiny_judge_scores_on_a_gpu_of_its_own(tmp_path):
    import ray

    from megarl.config.reward_sections import RewardJudgeConfig
    from megarl.models.tiny import build_tiny_model
    from megarl.ray_cluster.session import ray_session
    from megarl.rollout.judge import start_judge

    # head_dim 64 (hidden 256 / 4 heads): what SGLang's attention kernels support everywhere.
    model = build_tiny_model(tmp_path / "judge", "qwen2", task_vocab="0123456789", dtype="bfloat16", hidden_size=256,
                             num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512, max_position_embeddings=256)  # fmt: skip
    cfg = RewardJudgeConfig(model=str(model), engine="sglang", prompt_template="{prompt}={response}?", parser="number",
                            max_new_tokens=4, retries=0, max_running_requests=8, mem_fraction=0.3, gpus=1)  # fmt: skip
    logs = tmp_path / "logs"
    with ray_session(None, num_cpus=2, num_gpus=1):
        judge = start_judge(cfg, in_process=False, log_dir=logs, start_timeout_s=900, max_failed_fraction=1.0, gpus=(0,))
        try:
            scored = judge.score(PROMPTS, RESPONSES, RESPONSES, ["reverse_digits"] * 4)
            assert len(scored.scores) == 4 and scored.timeouts == 0
            assert scored.errors < len(PROMPTS)  # some output was read as a score
            assert ray.available_resources().get("GPU", 0.0) == 0.0  # its placement group holds the GPU
        finally:
            judge.close()
        assert "CUDA_VISIBLE_DEVICES=" in (logs / "judge_sglang0.log").read_text()  # the launch header
        for _ in range(60):  # released with the judge (Ray reports it shortly after)
            if ray.available_resources().get("GPU", 0.0) == 1.0:
                break
            time.sleep(0.5)
        assert ray.available_resources().get("GPU", 0.0) == 1.0
