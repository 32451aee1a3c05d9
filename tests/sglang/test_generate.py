"""`megarl generate rollout.engine=sglang` through a real SGLang server on this CPU: the server
starts from the HF directory, answers every prompt, and its greedy responses are the torch
engine's (fp32, the same weights); the server is gone afterwards."""

from __future__ import annotations

import psutil
import pyarrow.parquet as pq
import pytest

from megarl.commands.demo import prepare_demo
from megarl.commands.generate import generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_generate_through_the_real_server_equals_the_torch_engine(sglang_python, tmp_path):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
    model, data = prepare_demo(tmp_path / "demo")
    greedy = [f"model.path={model}", "rollout.n=2", "rollout.sampling.temperature=0", "rollout.sampling.max_new_tokens=4"]
    server = [*greedy, "rollout.engine=sglang", f"rollout.server_python={sglang_python}", "rollout.mem_fraction=0.05"]
    by_server = pq.read_table(generate(config, server, data / "val.parquet", tmp_path / "sglang.parquet")).to_pylist()
    by_torch = pq.read_table(generate(config, greedy, data / "val.parquet", tmp_path / "torch.parquet")).to_pylist()
    assert len(by_server) == len(by_torch) == 200
    assert all(len(r["responses"]) == 2 and set(r["finish_reasons"]) <= {"stop", "length"} for r in by_server)
    same = sum(a["responses"] == b["responses"] for a, b in zip(by_server, by_torch, strict=True))
    assert same >= 0.95 * len(by_torch)  # greedy fp32 on the same weights; a near-tie may flip a few
    assert (tmp_path / "sglang.parquet.partial").exists() is False
    left = [p for p in psutil.process_iter(["cmdline"]) if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
            and str(model) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert left == []  # shut down with the command
