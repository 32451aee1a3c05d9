"""A weight push that stalls ends in a named error, not a hang.

A real `megarl launch` (Ray, two policy ranks, the torch engines fed in process) on a model
large enough for a push to take many 1 MiB buckets. While a push runs, the test stops policy
rank 1 (SIGSTOP) once its progress file says it is exporting its third bucket. Rank 0 then
waits for it inside a collective. With ``rollout.weight_sync.timeout_s=5`` the driver must
stop the run within seconds, naming rank 1 (it could not write its stacks: stopped), where
each rank was, and the deadline; and leave no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


def _rank_pid(log: Path) -> int | None:
    """The pid a rank announces in the first line of its log."""
    try:
        m = re.search(r"\[megarl\] rank \d+ pid (\d+):", log.read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _stop_mid_push(run: Path, proc: subprocess.Popen, deadline_s: float = 300) -> int:
    """SIGSTOP policy rank 1 while its progress file shows it exporting bucket >= 3; its pid."""
    logs, deadline = run / "logs", time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the test could stop a rank mid-push"
        try:
            phase = (logs / "policy_rank1.log.push").read_text()
        except OSError:
            phase = ""
        m = re.search(r"\texporting bucket (\d+)", phase)
        pid = _rank_pid(logs / "policy_rank1.log")
        if m and int(m.group(1)) >= 3 and pid is not None:
            os.kill(pid, signal.SIGSTOP)
            return pid
        time.sleep(0.005)
    raise AssertionError("no push reached its third bucket on rank 1")


def test_a_stalled_rank_mid_push_ends_in_a_named_error(tmp_path):
    from megarl.commands.demo import prepare_demo
    from megarl.models.tiny import build_tiny_model

    _, data = prepare_demo(tmp_path / "demo")
    # ~19M parameters (76 MB in fp32): about 70 buckets of 1 MiB per push.
    model = build_tiny_model(tmp_path / "model", "qwen2", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2,
                             ffn_hidden_size=1408)  # fmt: skip
    run = tmp_path / "run"
    args = [sys.executable, "-m", "megarl.cli", "launch", str(TINY), f"model.path={model}",
            f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
            f"trainer.output_dir={run}", "trainer.total_steps=50", "trainer.eval_before_train=false",
            "trainer.eval_freq=50", "trainer.save_freq=0", "trainer.loggers=[jsonl]", "data.prompts_per_step=4",
            "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4", "rollout.weight_sync.bucket_mb=1",
            "rollout.weight_sync.check_logprobs=false", "rollout.weight_sync.timeout_s=5",
            "data.max_prompt_length=128"]  # fmt: skip
    log = tmp_path / "driver.out"
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        stopped = _stop_mid_push(run, proc)
        family = psutil.Process(proc.pid).children(recursive=True)
        started = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - started
        text = log.read_text()
        assert proc.returncode == 2, text[-3000:]
        line = next(ln for ln in text.splitlines() if ln.startswith("error: weight push"))
        assert "did not finish within 5 s (rollout.weight_sync.timeout_s)" in line, line
        assert "policy rank(s) [1] did not write their stacks: stopped or dead" in line, line
        # Where each rank was: rank 1 where it was stopped; rank 0 anywhere later (at TP=1 its
        # export needs no partner, so it may have reached the check that does).
        assert re.search(r"policy rank 1 \(stage 0\): exporting bucket [3-9]", line), line
        assert "; policy rank 0 (stage 0): " in line, line
        assert took < 60, f"the run took {took:.0f} s to stop after the stall"
        assert "most recent call first" in (run / "logs" / "policy_rank0.log").read_text()  # rank 0's stacks
        gone = psutil.wait_procs([p for p in family if p.is_running()], timeout=20)[1]
        assert not [p for p in gone if p.status() != psutil.STATUS_ZOMBIE], gone
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
