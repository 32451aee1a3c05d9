"""Exact resume: a run SIGKILLed after its step-k checkpoint, resumed, logs the same metrics for
steps k+1.. as an uninterrupted run with the same seed, and ends with the same parameters; a torn
newer checkpoint directory is skipped with a warning. Each run is a real `megarl launch` process
(embedded Ray inside), so the kill takes down driver, Ray and workers together."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import TINY, kill_after_checkpoint, read_jsonl, small_overrides

pytestmark = pytest.mark.slow
STEPS, SAVE_FREQ = 8, 2
# Wall-clock measurements differ between runs by nature; everything else must be identical.
TIMING = ("time/", "weight_sync/seconds", "weight_sync/gbps")


def launch_cmd(root: Path, out: Path, *extra: str) -> list[str]:
    overrides = small_overrides(root, out, STEPS, f"trainer.save_freq={SAVE_FREQ}", "trainer.eval_freq=4", *extra)
    return [sys.executable, "-m", "megarl.cli", "launch", str(TINY), *overrides]


def run_to_end(cmd: list[str], log: Path) -> None:
    with log.open("a") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=600, start_new_session=True)
    assert proc.returncode == 0, log.read_text()[-3000:]


def tear_newer_copy(out: Path) -> Path:
    """A newer checkpoint directory whose files do not match its manifest (a torn save)."""
    steps = sorted((out / "checkpoints").glob("step_*"))
    latest = steps[-1]
    torn = latest.with_name(f"step_{int(latest.name.split('_')[1]) + 1:06d}")
    shutil.copytree(latest, torn)
    victim = next(p for p in sorted(torn.rglob("*")) if p.is_file() and p.name != "manifest.json" and p.stat().st_size > 8)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return torn


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def test_sigkill_then_resume_is_exact(tmp_path):
    root = tmp_path / "demo"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    run_to_end(launch_cmd(root, reference), tmp_path / "reference.log")
    kill_after_checkpoint(launch_cmd(root, killed), killed, SAVE_FREQ, tmp_path / "killed.log")
    survivors = sorted(p.name for p in (killed / "checkpoints").glob("step_*"))
    assert survivors and f"step_{STEPS:06d}" not in survivors, f"the kill came too late: {survivors}"
    resumed_from = int(survivors[-1].split("_")[1])
    torn = tear_newer_copy(killed)

    run_to_end(launch_cmd(root, killed), tmp_path / "resumed.log")

    resumed_log = (tmp_path / "resumed.log").read_text()
    assert torn.name in resumed_log and "skip" in resumed_log.lower()  # the torn one was reported, not used
    expected = {r["step"]: comparable(r) for r in read_jsonl(reference / "metrics.jsonl")}
    got = {r["step"]: comparable(r) for r in read_jsonl(killed / "metrics.jsonl")}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(resumed_from + 1, STEPS + 1):
        assert got[step] == expected[step], f"step {step} differs after resuming from step {resumed_from}"
    assert got[STEPS]["actor/param_checksum"] == expected[STEPS]["actor/param_checksum"]

    # Going back to an older checkpoint of the finished run: the same steps again, the newer
    # checkpoints and the metrics records cut kept aside, never replaced.
    back = STEPS - 2 * SAVE_FREQ
    run_to_end(launch_cmd(root, killed, f"trainer.resume={killed / 'checkpoints' / f'step_{back:06d}'}"), tmp_path / "back.log")
    again = {r["step"]: comparable(r) for r in read_jsonl(killed / "metrics.jsonl")}
    assert sorted(again) == list(range(1, STEPS + 1)) and again == got
    [cut] = killed.glob(f"metrics.steps{back + 1}-{STEPS}.*.jsonl")
    assert [comparable(r) for r in read_jsonl(cut)] == [got[s] for s in range(back + 1, STEPS + 1)]
    steps = sorted(p.name for p in (killed / "checkpoints").glob("step_*"))
    assert {f"step_{s:06d}.abandoned" for s in range(back + SAVE_FREQ, STEPS + 1, SAVE_FREQ)} <= set(steps)
    assert f"step_{STEPS:06d}" in steps
    # each checkpoint keeps the records that led to it (a later resume from it takes them back)
    assert read_jsonl(killed / "checkpoints" / f"step_{STEPS:06d}" / "metrics.jsonl") == read_jsonl(killed / "metrics.jsonl")
