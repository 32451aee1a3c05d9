"""Wall time of `megarl plan` as a whole process (target < 2 s: torch, megatron and ray stay
off the planning path). Prints a table and writes bench/results/plan.json.

    .venv/bin/python bench/plan.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "qwen72b_grpo (ok)": ["configs/qwen72b_grpo.yaml"],
    "qwen2.5_7b_ppo (ok)": ["configs/qwen2.5_7b_ppo.yaml"],
    "qwen72b_grpo tp=3 (refused)": ["configs/qwen72b_grpo.yaml", "actor.parallel.tp=3"],
}
REPEATS = 5


def time_command(args: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "plan", *args], cwd=ROOT, capture_output=True)
    return time.perf_counter() - start, proc.returncode


def main() -> None:
    rows = []
    for name, args in CASES.items():
        times, codes = zip(*(time_command(args) for _ in range(REPEATS)))
        rows.append({"case": name, "median_s": statistics.median(times), "max_s": max(times), "exit_code": codes[0]})
    print(f"{'case':32} {'median s':>9} {'max s':>7} {'exit':>5}")
    for r in rows:
        print(f"{r['case']:32} {r['median_s']:9.3f} {r['max_s']:7.3f} {r['exit_code']:5d}")
    out = {
        "machine": describe(),
        "target_s": 2.0,
        "rows": rows,
    }
    (ROOT / "bench" / "results" / "plan.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
