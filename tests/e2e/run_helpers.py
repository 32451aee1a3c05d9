"""Shared set-up of the trainer's end-to-end tests: the demo's tiny model and data, small configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from megarl.commands.demo import prepare_demo
from megarl.config.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"

# Every GRPO step writes at least these (docs/metrics.md's table; megarl/metrics.py).
REQUIRED_METRICS = (
    "step", "reward/mean", "reward/errors", "response_length/mean", "response/truncated_frac", "actor/kl",
    "actor/entropy", "actor/clip_frac", "actor/ppo_kl", "actor/loss", "actor/grad_norm", "actor/lr",
    "actor/optimizer_steps", "rollout/logprob_mismatch", "reward/zero_var_group_frac", "advantages/mean",
    "time/step_s", "time/generate_s", "time/policy_update_s", "weight_sync/gbps",
)


def small_overrides(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The demo config shrunk to a few seconds a step on 2 cores."""
    model, data = prepare_demo(root)
    return [
        f"model.path={model}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'val.parquet'}]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.eval_before_train=false",
        f"trainer.eval_freq={steps}",
        "trainer.save_freq=0",
        "trainer.loggers=[jsonl]",
        "data.prompts_per_step=8",
        "rollout.n=4",
        "actor.mini_batch_size=32",
        "actor.micro_batch_size=16",
        "rollout.weight_sync.check_logprobs_every=1",  # the tests check every push, not the default's every 10th
        *extra,
    ]


def small_config(root: Path, out: Path, steps: int, *extra: str):
    return load_config(TINY, small_overrides(root, out, steps, *extra))


def steps_logged(run: Path) -> list[int]:
    """The steps in ``run``'s metrics.jsonl so far; a line being appended is not read
    half-written."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    whole = text[: text.rfind("\n") + 1]
    return [json.loads(line)["step"] for line in whole.splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(demo_root: Path, out: Path, steps: int, *extra: str):
    """A short run of the demo config through Ray: ``(config, last metrics, metrics.jsonl records)``."""
    from megarl.plan.planner import make_plan
    from megarl.trainer.launch import run

    cfg = small_config(demo_root, out, steps, *extra)
    last = run(cfg, make_plan(cfg, check_files=True))
    return cfg, last, read_jsonl(out / "metrics.jsonl")


def kill_after_checkpoint(cmd: list[str], out: Path, step: int, log: Path) -> None:
    """Start the run in a session of its own, SIGKILL its whole process group as soon as the
    checkpoint of ``step`` is committed (its manifest written)."""
    marker = out / "checkpoints" / f"step_{step:06d}" / "manifest.json"
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None, f"the run ended before checkpoint {step}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint {step} within 10 minutes"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def hf_tensors(directory: Path) -> dict:
    """Every tensor of the safetensors files in ``directory`` (an HF model or PEFT adapter)."""
    from safetensors.torch import load_file

    out: dict = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def lora_merged_reference(base_dir: Path, adapter_dir: Path) -> dict:
    """The merged model megarl must write for the HF base ``base_dir`` and the PEFT adapter
    ``adapter_dir``, computed here independently: every adapted ``W`` is
    ``(W.float() + alpha / r * sum_k B[:, k] A[k, :]).to(W.dtype)`` in fp32 with k ascending (the
    one elementwise formula of megarl/models/lora.py), every other tensor the base's."""
    import torch

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    base, adapters = hf_tensors(base_dir), hf_tensors(adapter_dir)
    merged = dict(base)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        b = adapters[key.replace(".lora_A.", ".lora_B.")].float()
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        delta = torch.zeros(b.shape[0], a.shape[1])
        for k in range(a.shape[0]):
            delta += b[:, k : k + 1] * a.float()[k : k + 1, :]
        merged[name] = (base[name].float() + scale * delta).to(base[name].dtype)
    return merged
