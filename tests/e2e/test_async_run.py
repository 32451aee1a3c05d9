"""Asynchronous training end to end (docs/async.md): the demo's tiny model with
``rollout.max_staleness=2``, the torch engine as a process of its own, SIGKILLed twice after a
checkpoint and resumed: every prompt of the epoch is trained exactly once (the prompt ledger),
each step is logged once (metrics.jsonl), and the staleness metrics stay within the bound (with
token-level TIS, reported per staleness)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from run_helpers import TINY, kill_after_checkpoint, read_jsonl, small_overrides

pytestmark = pytest.mark.slow
PROMPTS, PER_STEP, K = 24, 4, 2
STEPS = PROMPTS // PER_STEP


def _epoch_data(demo_root: Path, out: Path) -> Path:
    """The first PROMPTS rows of the demo's training file: one short epoch."""
    import pyarrow.parquet as pq

    from megarl.commands.demo import prepare_demo

    _, data = prepare_demo(demo_root)
    path = out.parent / "epoch.parquet"
    pq.write_table(pq.read_table(data / "train.parquet").slice(0, PROMPTS), path)
    return path


def _command(demo_root: Path, out: Path, train: Path) -> list[str]:
    overrides = small_overrides(demo_root, out, STEPS, "trainer.total_steps=null", "trainer.total_epochs=1",
                                f"data.train_files=[{train}]", f"data.prompts_per_step={PER_STEP}",
                                "actor.mini_batch_size=16", "actor.micro_batch_size=8", "trainer.save_freq=1",
                                "trainer.eval_freq=0", f"rollout.max_staleness={K}", "algorithm.tis.level=token")  # fmt: skip
    return [sys.executable, "-m", "megarl.cli", "launch", str(TINY), *overrides]


def test_every_prompt_is_trained_once_across_two_sigkills(demo_root, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    cmd = _command(demo_root, out, _epoch_data(demo_root, out))
    log = tmp_path / "driver.txt"
    kill_after_checkpoint(cmd, out, 2, log)
    from megarl.checkpoint.trainer_state import TrainerState

    pending = TrainerState.load(out / "checkpoints" / "step_000002").rollouts["pending"]
    assert pending, "the checkpoint holds the prompts drawn ahead of training (the resume re-issues them)"
    kill_after_checkpoint(cmd, out, 4, log)
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900, start_new_session=True)
    assert done.returncode == 0, log.read_text()[-3000:]

    ledger = read_jsonl(out / "prompt_ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(1, STEPS + 1))
    trained = Counter(tuple(k) for line in ledger for k in line["trained"])
    assert sorted(trained) == [(0, row) for row in range(PROMPTS)] and set(trained.values()) == {1}
    assert not any(line["dropped"] for line in ledger)

    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert 0 <= r["async/staleness_max"] <= K
        assert abs(sum(r[f"async/staleness{s}_frac"] for s in range(K + 1)) - 1) < 1e-6
        assert r["rollout/logprob_mismatch"] >= 0 and 0 <= r["async/trainer_idle_frac"] <= 1
        for s in range(K + 1):  # the TIS weights reported for each staleness the step trained
            if r[f"async/staleness{s}_frac"] > 0:
                assert r[f"rollout/tis_weight/staleness{s}"] > 0 and 0 <= r[f"rollout/tis_capped_frac/staleness{s}"] <= 1
    assert any(r["async/staleness_max"] >= 1 for r in records), "generation never ran ahead of training"
