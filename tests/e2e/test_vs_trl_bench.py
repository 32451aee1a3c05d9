"""bench/vs_trl.py for 2 steps of each side (megarl's demo, megarl in process and TRL's
GRPOTrainer on the same job): all run to the end and report step and phase times, memory, CPU
time and held-out rewards.
Skipped without the TRL venv (`make trl-venv`; CI does not build it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _trl_venv() -> Path:
    spec = importlib.util.spec_from_file_location("trl_venv_path", ROOT / "ci" / "trl" / "venv_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.venv_path()


@pytest.mark.skipif(not (_trl_venv() / "bin" / "python").exists(), reason="no TRL venv (make trl-venv)")
def test_both_sides_run_the_same_two_steps(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--steps", "2", "--seeds", "1", "--eval-every", "1",
                           "--sides", "megarl", "megarl (in-process)", "trl", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "results" / "vs_trl.json").read_text())
    assert set(out["sides"]) == {"megarl", "megarl (in-process)", "trl"} and out["machine"]["cores"] >= 1
    for side in out["sides"]:
        (run,) = [r for r in out["runs"] if r["side"] == side]
        assert run["steps"] == 2 and run["step_s"] > 0 and run["peak_pss_gib"] > 0, run
        assert {int(s) for s in run["held_out"]} == {0, 1, 2}
        assert all(0.0 <= v <= 1.0 for v in run["held_out"].values())
        assert 0 < out["sides"][side]["cores_busy"] <= out["machine"]["cores"] + 0.5, out["sides"][side]
    megarl, trl = out["sides"]["megarl"], out["sides"]["trl"]
    # megarl's reference log-probs are computed in the update's pass (KL in the loss only): no phase of their own
    assert {"generate", "reward", "policy_update", "weight_sync"} <= set(megarl["phases_s"])
    assert megarl["phases_s"].get("ref_logprobs", 0.0) < 1e-3  # the skipped phase's timer only
    (run,) = [r for r in out["runs"] if r["side"] == "megarl"]  # its end to end, span by span, from the stamped log
    assert list(run["milestones_s"]) == ["checks", "ray", "ranks", "first_push", "trained", "plotted"]
    assert sorted(run["milestones_s"].values()) == list(run["milestones_s"].values()) and run["milestones_s"]["plotted"] < run["wall_s"]
    assert megarl["fixed_s"] > 0 and sum(megarl["spans_s"].values()) == pytest.approx(megarl["wall_s"])
    assert {"generate", "reward", "ref_logprobs", "update"} <= set(trl["phases_s"])
    assert megarl["processes"] > trl["processes"] >= 1  # Ray, 2 ranks, reward workers against one process
    # in process: the command, its driver and the reward workers; no Ray
    in_process = out["sides"]["megarl (in-process)"]
    assert trl["processes"] < in_process["processes"] < megarl["processes"]
    (run,) = [r for r in out["runs"] if r["side"] == "megarl (in-process)"]
    assert "megarl driver" in run["pss_at_peak_gib"] and not any(name.startswith("ray") for name in run["pss_at_peak_gib"])
    # The same prompts in the same order: the TRL job's rows are megarl's sampler's for the seed.
    job = json.loads((tmp_path / "work" / "runs" / "trl-seed1" / "job.json").read_text())
    assert len(job["train_rows"]) == 2 * out["settings"]["prompts_per_step"] and len(job["val_rows"]) == 200
    assert "Settings TRL does not match" in (tmp_path / "results" / "vs_trl.md").read_text()
