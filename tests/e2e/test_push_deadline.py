"""A weight push that stalls or loses its receiver ends in a named error, not a hang.

Real `megarl launch` runs (Ray, two policy ranks) on a model large enough for a push to take
many 1 MiB buckets, with ``rollout.weight_sync.timeout_s=5``. The test watches a rank's
progress file (``<rank log>.push``) and strikes in the middle of a push:

- the torch engines fed in process: policy rank 1 is stopped (SIGSTOP) while it exports its
  third bucket. Rank 0 waits for it in a collective; the driver must stop the run within
  seconds naming rank 1 (it could not write its stacks: stopped) and where each rank was;
- the real SGLang server (disaggregated, the distributed transport over gloo; skipped without
  the SGLang CPU venv): the server is killed while rank 0 sends its third bucket. Rank 0's
  send fails; it still meets rank 1 at the transport's barriers, so every rank learns of the
  failure at once (no deadline needed), and the error names rank 0, the engine it was sending
  to and the cause.

Each run must leave no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


def _launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
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
            "data.max_prompt_length=128", *extra]  # fmt: skip
    log = tmp_path / "driver.out"
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run, log


def _strike_mid_push(run: Path, proc: subprocess.Popen, rank: int, phase: str, strike: Callable[[], None]) -> None:
    """Call ``strike`` once policy rank ``rank``'s progress shows ``phase`` (a regex whose
    group 1 is a bucket number) at bucket 3 to 20 of a push after the first: far from both ends
    of the ~70 buckets, so the rank is still inside the bucket stream when the strike lands
    (a late read of bucket 60 is let go, and the next push tried)."""
    progress, deadline = run / "logs" / f"policy_rank{rank}.log.push", time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the test could strike mid-push"
        try:
            version, place = progress.read_text().split("\t", 1)
        except (OSError, ValueError):
            version, place = "0", ""
        m = re.search(phase, place)
        if m and 3 <= int(m.group(1)) <= 20 and int(version) >= 1:
            strike()
            return
        time.sleep(0.005)
    raise AssertionError(f"no push was seen at {phase!r} at buckets 3 to 20 on rank {rank}")


def _stopped(proc: subprocess.Popen, log: Path, error: str = "error: weight push") -> str:
    """The run's error line (starting with ``error``), after checking it stopped within a minute
    with exit code 2 and took every process of its session along."""
    family = psutil.Process(proc.pid).children(recursive=True)
    started = time.monotonic()
    proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 2, text[-3000:]
    assert time.monotonic() - started < 60, "the run took over a minute to stop after the fault"
    alive = psutil.wait_procs([p for p in family if p.is_running()], timeout=20)[1]
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    line = next((ln for ln in text.splitlines() if ln.startswith(error)), None)
    assert line is not None, f"no line starting with {error!r}; the run's output ends with:\n{text[-3000:]}"
    return line


def test_a_stalled_rank_mid_push_ends_in_a_named_error(tmp_path):
    proc, run, log = _launch(tmp_path)
    stopped: list[int] = []

    def stop_rank_1() -> None:
        pid = _rank_pid(run / "logs" / "policy_rank1.log")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        _strike_mid_push(run, proc, 1, r"(?:\t|, )exporting bucket (\d+)", stop_rank_1)
        line = _stopped(proc, log)
        assert "did not finish within 5 s (rollout.weight_sync.timeout_s)" in line, line
        assert "policy rank(s) [1] did not write their stacks: stopped or dead" in line, line
        # Where each rank was: rank 1 where it was stopped; rank 0 anywhere later (at TP=1 its
        # export needs no partner, so it may have reached the check that does).
        # (it may have moved on between the test reading its place and the signal landing, as
        # far as the handover of the bucket it exported: any place inside the bucket stream)
        inside = r"(exporting|sending) bucket \d+|between buckets \(handing the next one to the sender\)"
        assert re.search(rf"policy rank 1 \(stage 0\): ({inside})", line), line
        assert "; policy rank 0 (stage 0): " in line, line
        assert "most recent call first" in (run / "logs" / "policy_rank0.log").read_text()  # rank 0's stacks
    finally:
        for pid in stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.sglang
def test_an_engine_killed_mid_push_is_named(tmp_path):
    from megarl.commands.demo import SGLANG_ON_CPU
    from megarl.rollout_sglang.cpu_venv import sglang_cpu_python

    python = sglang_cpu_python()
    if python is None:
        pytest.skip("no SGLang CPU venv: run `make sglang-cpu` to build it")
    proc, run, log = _launch(tmp_path, "rollout.engine=sglang", f"rollout.server_python={python}", *SGLANG_ON_CPU)

    def servers() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"])
                if "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and str(tmp_path) in " ".join(p.info["cmdline"] or [])]  # fmt: skip

    def kill_engine() -> None:
        for p in [*server.children(recursive=True), server]:
            p.kill()

    try:
        # Found before the strike: scanning every process's command line takes long enough for
        # a push to move on by many buckets.
        deadline = time.monotonic() + 300
        while not (found := servers()):
            assert proc.poll() is None and time.monotonic() < deadline, "the SGLang server never started"
            time.sleep(0.5)
        (server,) = found
        _strike_mid_push(run, proc, 0, r"\tsending bucket (\d+)", kill_engine)
        line = _stopped(proc, log, "error: policy rank")  # the failure itself, not the 5 s deadline
        # Whichever rank's error reaches the driver first: rank 0's own, or rank 1's export check
        # naming rank 0's (``weight push 1 failed on policy rank(s) [0]: ...``). The cause is
        # whichever channel to the killed engine broke first: the gloo broadcast (its transport's
        # error, worded by how the kernel tore the socket down: reset, closed, broken pipe) or
        # the HTTP request that goes with it (``SGLangUnreachable``: refused, closed, or an
        # answer cut short).
        assert re.search(r"^error: policy rank [01] .* raised (RuntimeError|WeightExportError) in PolicyRank.push_weights: "
                         r"(weight push \d+ failed on policy rank\(s\) \[0\]: RuntimeError: )?sending pipeline stage 0's "
                         r"weights to engine\(s\) http://[\d.]+:\d+ failed: (RuntimeError: \[[^\]]*/gloo/transport/[^\]]*\] "
                         r"|SGLangUnreachable: SGLang http://[\d.]+:\d+/update_weights_from_distributed: no answer)", line), line  # fmt: skip
        assert servers() == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
