"""This checkout against another (e.g. a worktree of the commit before a restructuring): the
start-up of `megarl --help` and of `megarl plan configs/qwen72b_grpo.yaml` as whole processes,
and with --tests the wall time of tests/distributed plus tests/e2e/test_trainer.py. The two
sides are interleaved (new, old, new, old, ...), each PYTHONPATH pointing at its own checkout;
medians and the ratio new / old. Writes bench/results/layout.json and prints a table.

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/layout.py --against /tmp/before [--tests]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "megarl --help": ["-m", "megarl.cli", "--help"],
    "megarl plan qwen72b_grpo": ["-m", "megarl.cli", "plan", "configs/qwen72b_grpo.yaml"],
}
TESTS = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/distributed", "tests/e2e/test_trainer.py"]


def run(checkout: Path, args: list[str], timeout: float) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds


def compare(name: str, args: list[str], against: Path, repeats: int, timeout: float,
            done: list[dict[str, object]] | None = None) -> dict[str, object]:  # fmt: skip
    """``repeats`` interleaved pairs; after each pair the rows so far (``done`` and this one) are
    written, so a long comparison stopped early keeps its pairs."""
    new: list[float] = []
    old: list[float] = []
    row: dict[str, object] = {}
    for _ in range(repeats):
        new.append(run(ROOT, args, timeout))
        old.append(run(against, args, timeout))
        ratios = [n / o for n, o in zip(new, old, strict=True)]
        row = {"case": name, "new_median_s": statistics.median(new), "old_median_s": statistics.median(old),
               "ratio_median": statistics.median(ratios), "pairs": len(new), "new_s": new, "old_s": old}  # fmt: skip
        write([*(done or []), row], against)
    return row


def write(rows: list[dict[str, object]], against: Path) -> None:
    out = {"machine": describe(), "load_now": os.getloadavg()[0], "against": str(against), "rows": rows}
    (ROOT / "bench" / "results" / "layout.json").write_text(json.dumps(out, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="the other checkout (old side)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved pairs of each start-up case")
    parser.add_argument("--tests", type=int, default=0, metavar="PAIRS", help="also time the test subset, PAIRS interleaved pairs")
    args = parser.parse_args()
    against = args.against.resolve()
    rows: list[dict[str, object]] = []
    for name, cmd in CASES.items():
        rows.append(compare(name, cmd, against, args.repeats, 300, rows))
    if args.tests:
        rows.append(compare("tests/distributed + tests/e2e/test_trainer.py", TESTS, against, args.tests, 3600, rows))
    print(f"{'case':48} {'new s':>8} {'old s':>8} {'new/old':>8}")
    for r in rows:
        print(f"{r['case']:48} {r['new_median_s']:8.2f} {r['old_median_s']:8.2f} {r['ratio_median']:8.3f}")


if __name__ == "__main__":
    main()
