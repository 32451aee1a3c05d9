"""The whole loop through a real SGLang server on this CPU: `megarl demo rollout.engine=sglang`.

The demo picks what SGLang on a CPU needs (a pool of its own, one server beside the 2 policy
ranks); weights reach the server over a gloo group, as a disaggregated GPU run pushes them
over NCCL; the post-push check and the train/inference mismatch are measured against the real
server's log-probs (fp32: they must agree to rounding).
"""

from __future__ import annotations

import json
import os

import psutil
import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_demo_trains_through_the_real_server(sglang_python, tmp_path, monkeypatch):
    from megarl.commands.demo import run_demo

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    root = tmp_path / "demo"
    run_demo("configs/tiny_grpo.yaml", ["rollout.engine=sglang", f"rollout.server_python={sglang_python}",
                                        "trainer.total_steps=2", "trainer.eval_freq=2", "trainer.save_freq=0",
                                        "trainer.loggers=[jsonl]", "rollout.weight_sync.check_logprobs_every=1"], root)  # fmt: skip
    records = [json.loads(line) for line in (root / "run-sglang" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["weight_sync/logprob_diff"] < 1e-5  # the pushed weights are the trainer's
        assert r["rollout/logprob_mismatch"] < 1e-5  # and the server samples with them
        assert 0 <= r["reward/mean"] <= 1
    assert "val/reward/mean" in records[-1]
    assert (root / "run-sglang" / "logs" / "sglang_engine0.log").stat().st_size > 0
    servers = [p for p in psutil.process_iter(["cmdline"]) if "sglang.launch_server" in " ".join(p.info["cmdline"] or [])
               and str(root) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert servers == []  # shut down with the run


def test_moe_demo_trains_through_the_real_server_with_routing_replay(sglang_python, tmp_path, monkeypatch):
    """configs/tiny_moe_grpo.yaml (EP=2, routing_replay: experts): the experts reach the server
    over the gloo group, which returns each token's experts, and the trainer replays them."""
    from megarl.commands.demo import run_demo

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    root = tmp_path / "moe-demo"
    run_demo("configs/tiny_moe_grpo.yaml", ["rollout.engine=sglang", f"rollout.server_python={sglang_python}",
                                            "trainer.total_steps=2", "trainer.eval_before_train=false", "trainer.eval_freq=0",
                                            "trainer.save_freq=0", "trainer.loggers=[jsonl]",
                                            "rollout.weight_sync.check_logprobs_every=1"], root)  # fmt: skip
    records = [json.loads(line) for line in (root / "run-sglang" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["weight_sync/logprob_diff"] < 1e-5  # every expert reached the server
        assert r["rollout/logprob_mismatch"] < 1e-5
    first = records[0]  # the replay metrics: measured at the first update with the engine's routing
    assert first["actor/moe/routing_agreement"] > 0.9 and first["actor/moe/logprob_diff_replay"] < 1e-5
    assert "--enable-return-routed-experts" in (root / "run-sglang" / "logs" / "sglang_engine0.log").read_text()


def test_lora_demo_pushes_adapters_to_the_real_server(sglang_python, tmp_path, monkeypatch):
    """actor.lora with rollout.weight_sync.lora=adapter: the base model reaches the server once,
    then each push loads only the adapters (a PEFT directory) and the server generates with them;
    the post-push check and the mismatch compare its log-probs with the trainer's adapted policy."""
    from megarl.commands.demo import run_demo

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    root = tmp_path / "lora-demo"
    run_demo("configs/tiny_grpo.yaml", ["rollout.engine=sglang", f"rollout.server_python={sglang_python}",
                                        "actor.lora.rank=8", "rollout.weight_sync.lora=adapter", "trainer.total_steps=3",
                                        "trainer.eval_before_train=false", "trainer.eval_freq=0", "trainer.save_freq=0",
                                        "trainer.loggers=[jsonl]", "rollout.weight_sync.check_logprobs_every=1"], root)  # fmt: skip
    records = [json.loads(line) for line in (root / "run-sglang" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["weight_sync/logprob_diff"] < 1e-5  # the server generates with the trainer's adapters
        assert r["rollout/logprob_mismatch"] < 1e-5
    assert records[-1]["actor/kl"] > 0  # the adapters moved the policy away from the base
    model_bytes = sum(f.stat().st_size for f in (root / "model").glob("*.safetensors"))
    assert all(r["weight_sync/bytes"] < model_bytes / 2 for r in records)  # adapters only after the first push
    assert sorted(p.name for p in (root / "run-sglang" / "weights").iterdir() if p.name.startswith("lora_v")) == ["lora_v2", "lora_v3"]
    assert "--enable-lora" in (root / "run-sglang" / "logs" / "sglang_engine0.log").read_text()
