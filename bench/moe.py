"""Mixture-of-experts on this machine, with the MoE demo config (configs/tiny_moe_grpo.yaml: a tiny
Qwen3-MoE, 4 experts, top-2, 2 policy processes), each case a real `megarl launch`:

- step cost: the policy update's time per step at ep=2 (experts split over the two processes,
  tokens exchanged all-to-all) against ep=1 (every process holds all four experts), the two
  interleaved (ep2, ep1, ep2, ...), the median per run over its steps after the first two,
  then the median of the per-pair ratios;
- routing: with actor.moe.routing_replay none / experts / experts_and_weights (torch engine,
  fp32 and bf16) and none / experts (SGLang's CPU server, fp32, when `make sglang-cpu` built
  it), the share of
  tokens the trainer routes as the engine did and the mean |trainer - engine| log-prob of the
  response tokens with and without replay, over a short run's steps.

Writes bench/results/moe.json and prints the tables; bench/results/moe.md is the summary.

    .venv/bin/python bench/moe.py [--repeats 3] [--steps 12] [--skip-routing]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_moe_grpo.yaml"
OUT = ROOT / "bench" / "results" / "moe.json"
# Routing metrics of a run (their means over its steps go to the table).
ROUTING_KEYS = ("actor/moe/routing_agreement", "actor/moe/logprob_diff_replay", "actor/moe/logprob_diff_no_replay")


def launch(root: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    """One run of the MoE demo config; its metrics.jsonl records."""
    from megarl.commands.demo import prepare_demo

    model, data = prepare_demo(root, arch="tiny-moe-demo")
    args = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
            f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.eval_before_train=false",
            "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.loggers=[jsonl]", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "launch", str(CONFIG), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"megarl launch {' '.join(extra)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_cost(root: Path, work: Path, steps: int, repeats: int) -> dict:
    """ep=2 against ep=1: medians of time/policy_update_s and time/step_s, and their pair ratios."""
    sides: dict[int, dict[str, list[float]]] = {ep: {"update": [], "step": []} for ep in (2, 1)}
    for rep in range(repeats):
        for ep in (2, 1):
            records = launch(root, work / f"ep{ep}-{rep}", steps, f"actor.parallel.ep={ep}")[2:]
            sides[ep]["update"].append(statistics.median(r["time/policy_update_s"] for r in records))
            sides[ep]["step"].append(statistics.median(r["time/step_s"] for r in records))
    ratio = {k: statistics.median(a / b for a, b in zip(sides[2][k], sides[1][k], strict=True)) for k in ("update", "step")}
    return {"steps": steps, "repeats": repeats, "ep2": sides[2], "ep1": sides[1], "ratio_ep2_over_ep1": ratio}


def routing(root: Path, work: Path, steps: int) -> list[dict]:
    """One short run per engine and replay mode; the means of ROUTING_KEYS over its steps."""
    from megarl.rollout_sglang.cpu_venv import sglang_cpu_python

    # fp32 engine and trainer compute the same routing; bf16 rounds differently on the two sides.
    cases = [("torch", mode, [f"model.dtype={dtype}"]) for dtype in ("float32", "bfloat16")
             for mode in ("none", "experts", "experts_and_weights")]  # fmt: skip
    python = sglang_cpu_python()
    if python is not None:
        from megarl.commands.demo import SGLANG_ON_CPU

        extra = ["rollout.engine=sglang", f"rollout.server_python={python}", *SGLANG_ON_CPU]
        cases += [("sglang", mode, extra) for mode in ("none", "experts")]
    rows = []
    for engine, mode, extra in cases:
        dtype = next((e.split("=")[1] for e in extra if e.startswith("model.dtype=")), "float32")
        records = launch(root, work / f"{engine}-{dtype}-{mode}", steps, f"actor.moe.routing_replay={mode}", *extra)
        row: dict = {"engine": engine, "dtype": dtype, "routing_replay": mode}
        for key in ROUTING_KEYS:
            values = [r[key] for r in records if key in r]
            row[key] = statistics.mean(values) if values else None
        row["rollout/logprob_mismatch"] = statistics.mean(r["rollout/logprob_mismatch"] for r in records)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved ep2/ep1 pairs")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--skip-routing", action="store_true", help="only the step cost")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-moe-") as tmp:
        work = Path(tmp)
        result: dict = {"machine": describe(), "config": str(CONFIG.relative_to(ROOT))}
        result["step_cost"] = step_cost(work / "demo", work, args.steps, args.repeats)
        if not args.skip_routing:
            result["routing"] = routing(work / "demo", work, args.steps)
        result["load_after"] = os.getloadavg()[0]
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    cost = result["step_cost"]
    print(f"step cost, median of {cost['repeats']} interleaved pairs: ep2/ep1 policy update "
          f"{cost['ratio_ep2_over_ep1']['update']:.3f}, whole step {cost['ratio_ep2_over_ep1']['step']:.3f}")
    for row in result.get("routing", []):
        shown = "  ".join(f"{k.split('/')[-1]} {row[k]:.3g}" if row[k] is not None else f"{k.split('/')[-1]} -"
                          for k in (*ROUTING_KEYS, "rollout/logprob_mismatch"))  # fmt: skip
        print(f"{row['engine']:7} {row['dtype']:9} {row['routing_replay']:20} {shown}")


if __name__ == "__main__":
    main()
