"""bench/reference_fusion.py for 2 rounds: both sides timed, and the fused update (the reference
in the update's pass) gives the numbers of the apart one (the reference's own pass first)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_both_sides_timed_and_equal(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_PORT=str(_free_port()))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "reference_fusion.py"), "--repeats", "2", "--warmup", "1",
                           "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "results" / "reference_fusion.json").read_text())
    assert set(out["seconds"]) == {"fused", "apart"} and out["machine"]["load_avg_1m_after"] >= 0
    for side in ("fused", "apart"):
        assert len(out["seconds"][side]) == 2 and all(t > 0 for t in out["seconds"][side])
        assert len(out["warmup_seconds"][side]) == 1 and out["median_s"][side] > 0
    assert out["ratio_fused_to_apart"] > 0 and out["config"]["samples"] == 256
    p = out["parity"]
    assert p["passed"] and p["fused_repeat_exact"], p
    # a real update with a real KL term: the weights moved, the KL is not zero
    assert p["max_abs_weight_step"] > 0 and p["compared"]["actor/kl"]["fused"] > 0
    assert "fused / apart" in (tmp_path / "results" / "reference_fusion.md").read_text()
