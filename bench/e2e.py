"""Step-time breakdown of the CPU demo: seconds per phase, and the share of the step spent
outside the timed phases (controller overhead: Ray calls, batch building; target < 5 %).

    .venv/bin/python bench/e2e.py [--steps 40]

Runs configs/tiny_grpo.yaml (the demo's model and data, built once under outputs/bench_e2e)
without validation or checkpoints, and writes bench/results/e2e.json and e2e.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
SKIP_WARMUP = 3  # the first steps pay one-off costs (allocations, forkserver start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    from megarl.commands.demo import run_demo

    work = ROOT / "outputs" / "bench_e2e"
    overrides = [f"trainer.total_steps={steps}", "trainer.eval_freq=0", "trainer.eval_before_train=false",
                 "trainer.save_freq=0", "trainer.loggers=[jsonl]", "trainer.resume=disable"]
    os.chdir(ROOT)
    run_demo(ROOT / "configs" / "tiny_grpo.yaml", overrides, root=work)
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    report(records[SKIP_WARMUP:-1])  # the last step also saves a checkpoint


def report(records: list[dict]) -> None:
    phases = sorted({k for r in records for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"})
    mean = {p: statistics.mean(r.get(p, 0.0) for r in records) for p in phases}
    step = statistics.mean(r["time/step_s"] for r in records)
    outside = step - sum(mean.values())
    rows = [(p.removeprefix("time/").removesuffix("_s"), mean[p]) for p in phases] + [("(outside phases)", outside)]
    print(f"{'phase':22} {'ms/step':>9} {'share':>7}")
    for name, secs in sorted(rows, key=lambda r: -r[1]):
        print(f"{name:22} {secs * 1e3:9.1f} {secs / step:7.1%}")
    print(f"{'step':22} {step * 1e3:9.1f}   over {len(records)} steps; overhead target < 5%")
    out = {
        "machine": describe(),
        "steps_measured": len(records),
        "step_ms": step * 1e3,
        "phases_ms": {name: secs * 1e3 for name, secs in rows},
        "outside_share": outside / step,
        "target_outside_share": 0.05,
    }
    results = ROOT / "bench" / "results"
    (results / "e2e.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["| phase | ms/step | share |", "|---|---|---|"]
    lines += [f"| {n} | {s * 1e3:.1f} | {s / step:.1%} |" for n, s in sorted(rows, key=lambda r: -r[1])]
    lines.append(f"| **step** | {step * 1e3:.1f} | 100% |")
    (results / "e2e.md").write_text(f"# CPU demo step breakdown ({out['machine']['date']}, {out['machine']['cpu']}, load {out['machine']['load_avg_1m']})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
