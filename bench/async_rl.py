"""Asynchronous RL on this machine: rollout.max_staleness 0 (synchronous) against 1 and 2 (and 1 with
algorithm.old_logprobs=engine), each case a real `megarl launch` of the CPU demo config
(configs/tiny_grpo.yaml):

- throughput: samples per second with one policy rank (cluster.gpus_per_node=1) and, in the
  asynchronous runs, the torch engine in a process of its own (one thread each), on a variant of
  the demo task where generation is about half of a synchronous step (max_new_tokens 32, at most
  64 rows decoded together: four decode waves per step); runs interleaved (sync, k1, k2, sync,
  ...), each run's median seconds per step after the warm-up steps, then the median over the
  repeats; the speed-up against the limit (T_gen + T_train) / max(T_gen, T_train) from the
  synchronous runs' own phase times, and each side's busy share;
- learning: held-out reward (val/reward/mean, every 20 steps) of the demo config as it is (DP=2,
  its task) with three seeds per mode, at equal steps and at equal wall time;
- sglang: the demo through the real SGLang CPU server (`megarl demo rollout.engine=sglang`'s
  placement), synchronous against staleness 1 (recomputed old log-probs, and the engine's), one
  seed and fewer steps (the CPU server is slow): the run trains to the end; held-out reward,
  log-prob mismatch by staleness, aborted samples and push seconds.

Writes bench/results/async_rl.json and prints the tables; bench/results/async_rl.md is the summary.

    .venv/bin/python bench/async_rl.py [--part throughput|learning|sglang|all] [--modes k0 k1 ...] [--quick]

`--part all` runs throughput and learning; `sglang` runs only when asked (it needs `make sglang-cpu`).

A throughput part run again moves the file's earlier throughput results to its "earlier" list.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_grpo.yaml"
OUT = ROOT / "bench" / "results" / "async_rl.json"
# Throughput modes: rollout.max_staleness 0, 1, 2, and 1 with the engine's log-probs as the old
# ones (algorithm.old_logprobs=engine: no old-log-prob forward on the trainer).
MODES = {"k0": ("rollout.max_staleness=0",), "k1": ("rollout.max_staleness=1",), "k2": ("rollout.max_staleness=2",),
         "k1_engine": ("rollout.max_staleness=1", "algorithm.old_logprobs=engine")}  # fmt: skip
SKIP_WARMUP = 4  # the first steps pay one-off costs (allocations, the engine's first draws)
# The throughput task: one policy rank; generation about half of a synchronous step. The demo's
# 4 new tokens make generation ~20 % of a step, too little for overlap to matter; with 32 new
# tokens (the untrained model runs to the cap in some row of every wave) and 64 rows decoded at
# once (256 samples = 4 waves) generate_s ~ the rest of the step on this machine.
THROUGHPUT = ("cluster.gpus_per_node=1", "rollout.sampling.max_new_tokens=32", "rollout.max_running_requests=64")
SAMPLES_PER_STEP = 32 * 8  # the demo's data.prompts_per_step x rollout.n
TARGET_SHARE = 0.8  # of the overlap limit, at k=1
TARGET_REWARD = 0.7


def launch(root: Path, out: Path, steps: int, *extra: str) -> tuple[list[dict], float]:
    """One run of the demo config; its metrics.jsonl records and the launch's wall seconds."""
    from megarl.commands.demo import prepare_demo

    model, data = prepare_demo(root)
    args = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
            f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.save_freq=0", "trainer.loggers=[jsonl]",
            "trainer.resume=disable", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "launch", str(CONFIG), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"megarl launch {' '.join(extra)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()], wall


def med(records: list[dict], key: str) -> float:
    """A step without the key counts 0 (an async step whose take found no new draw has no time/generate_s)."""
    return statistics.median(r.get(key, 0.0) for r in records)


def throughput(root: Path, work: Path, steps: int, repeats: int, names: tuple[str, ...] = tuple(MODES)) -> dict:
    """Interleaved runs per mode (``names``, k0 first: the speed-ups are against it); per run the
    medians over the steps after the warm-up (the last step, which saves a checkpoint, left out)."""
    names = ("k0", *(k for k in names if k != "k0"))
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for rep in range(repeats):
        for k in names:
            load = os.getloadavg()[0]
            records, wall = launch(root, work / f"tp-{k}-{rep}", steps, *THROUGHPUT, "trainer.eval_freq=0",
                                   "trainer.eval_before_train=false", *MODES[k])  # fmt: skip
            steady = [r for r in records if "time/step_s" in r][SKIP_WARMUP:-1]
            run = {"step_s": med(steady, "time/step_s"), "generate_s": med(steady, "time/generate_s"),
                   "policy_update_s": med(steady, "time/policy_update_s"), "load_1m": load, "wall_s": wall,
                   "response_length": statistics.mean(r["response_length/mean"] for r in steady)}  # fmt: skip
            # the rest of the step: the trainer's own work (sync: all but generation; async: all but the wait)
            wait = "time/generate_s" if k == "k0" else "time/rollout_wait_s"
            run["train_s"] = statistics.median(r["time/step_s"] - r.get(wait, 0.0) for r in steady)
            for key in ("time/rollout_wait_s", "time/old_logprobs_s", "time/weight_sync_s", "time/ref_logprobs_s",
                        "async/trainer_idle_frac", "async/engine_idle_frac", "async/staleness_mean"):  # fmt: skip
                if any(key in r for r in steady):
                    run[key] = med(steady, key)
            run["samples_per_s"] = SAMPLES_PER_STEP / run["step_s"]
            runs[k].append(run)
            print(f"  throughput rep {rep} {k}: {run['step_s']:.3f} s/step, generate {run['generate_s']:.3f} s, "
                  f"trainer's own {run['train_s']:.3f} s, load {load:.2f}", flush=True)
    sync = runs["k0"]
    t_gen = statistics.median(r["generate_s"] for r in sync)
    t_train = statistics.median(r["train_s"] for r in sync)
    limit = (t_gen + t_train) / max(t_gen, t_train)
    modes = {}
    for k in names:
        speedups = [s["step_s"] / r["step_s"] for s, r in zip(sync, runs[k], strict=True)]  # per interleaved repeat
        row = {"step_s": statistics.median(r["step_s"] for r in runs[k]),
               "samples_per_s": statistics.median(r["samples_per_s"] for r in runs[k]),
               "speedup": statistics.median(speedups), "speedups": speedups,
               "train_s": statistics.median(r["train_s"] for r in runs[k]),
               "generate_s": statistics.median(r["generate_s"] for r in runs[k])}  # fmt: skip
        row["share_of_limit"] = row["speedup"] / limit
        row["reaches_target_share"] = row["share_of_limit"] >= TARGET_SHARE
        for key in ("async/trainer_idle_frac", "async/engine_idle_frac", "async/staleness_mean",
                    "time/old_logprobs_s", "time/weight_sync_s"):  # fmt: skip
            if key in runs[k][0]:
                row[key] = statistics.median(r[key] for r in runs[k])
        modes[k] = row
    return {"steps": steps, "repeats": repeats, "skip_warmup": SKIP_WARMUP, "overrides": list(THROUGHPUT),
            "samples_per_step": SAMPLES_PER_STEP, "sync_generate_s": t_gen, "sync_train_s": t_train,
            "sync_generate_share": t_gen / (t_gen + t_train), "limit": limit, "modes": modes, "runs": runs}  # fmt: skip


def curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, seconds of training so far, val reward) at each evaluation; the seconds are the sum
    of the steps' time/step_s and time/validate_s (the launch's start-up left out)."""
    out, clock = [], 0.0
    for r in records:
        clock += r.get("time/step_s", 0.0) + r.get("time/validate_s", 0.0)
        if "val/reward/mean" in r:
            out.append((r["step"], clock, r["val/reward/mean"]))
    return out


def at_time(points: list[tuple[int, float, float]], budget: float) -> float:
    """The val reward of the last evaluation done within ``budget`` seconds."""
    return [p[2] for p in points if p[1] <= budget + 1e-9][-1]


# The learning runs: the synchronous loop, staleness 1 and 2 as configured by the demo, and
# staleness 1 with decoupled PPO's behaviour weight (algorithm.tis at token level, cap 2).
LEARN_MODES = {"k0": ("rollout.max_staleness=0",), "k1": ("rollout.max_staleness=1",), "k2": ("rollout.max_staleness=2",),
               "k1_tis": ("rollout.max_staleness=1", "algorithm.tis.level=token"),
               "k1_engine": ("rollout.max_staleness=1", "algorithm.old_logprobs=engine")}  # fmt: skip


def learning(root: Path, work: Path, steps: int, seeds: tuple[int, ...], names: tuple[str, ...] = tuple(LEARN_MODES)) -> dict:
    curves: dict[str, list[list[tuple[int, float, float]]]] = {k: [] for k in names}
    walls: dict[str, list[float]] = {k: [] for k in names}
    for seed in seeds:
        for k in names:
            records, wall = launch(root, work / f"learn-{k}-s{seed}", steps, "trainer.eval_freq=20",
                                   f"trainer.seed={seed}", *LEARN_MODES[k])  # fmt: skip
            curves[k].append(curve(records))
            walls[k].append(wall)
            pts = curves[k][-1]
            print(f"  learning seed {seed} {k}: val reward {pts[-1][2]:.3f} at step {pts[-1][0]}, "
                  f"{pts[-1][1]:.0f} s training, {wall:.0f} s launch, load {os.getloadavg()[0]:.2f}", flush=True)
    # equal wall time: the shortest mode's mean training time; each run's reward at that budget
    train_s = {k: statistics.mean(c[-1][1] for c in curves[k]) for k in names}
    budget = min(train_s.values())
    modes = {}
    for k in names:
        final = [c[-1][2] for c in curves[k]]
        steps_axis = [p[0] for p in curves[k][0]]
        mean_curve = [statistics.mean(c[i][2] for c in curves[k]) for i in range(len(steps_axis))]
        reached = next((s for s, v in zip(steps_axis, mean_curve, strict=True) if v >= TARGET_REWARD), None)
        modes[k] = {"final_reward_mean": statistics.mean(final), "final_rewards": final,
                          "train_s_mean": train_s[k], "launch_s_mean": statistics.mean(walls[k]),
                          "reward_at_equal_time_mean": statistics.mean(at_time(c, budget) for c in curves[k]),
                          "first_step_mean_reward_ge_target": reached, "mean_curve": list(zip(steps_axis, mean_curve)),
                          "curves": curves[k]}  # fmt: skip
    return {"steps": steps, "seeds": list(seeds), "eval_freq": 20, "equal_time_budget_s": budget,
            "target_reward": TARGET_REWARD, "modes": modes}  # fmt: skip


SGLANG_MODES = {"k0": ("rollout.max_staleness=0",), "k1": ("rollout.max_staleness=1",),
                "k1_engine": ("rollout.max_staleness=1", "algorithm.old_logprobs=engine")}  # fmt: skip
# Keys of each step's record reported per run (the last value over the run, or the mean where said).
SGLANG_MEANS = ("rollout/logprob_mismatch", "rollout/logprob_mismatch/staleness0", "rollout/logprob_mismatch/staleness1",
                "async/staleness_mean", "async/staleness1_frac", "time/weight_sync_s", "time/step_s")  # fmt: skip


def sglang_runs(root: Path, work: Path, steps: int) -> dict:
    """The demo through the real SGLang server on this CPU, k=0 then k=1 (engine log-probs)."""
    from megarl.commands.demo import sglang_on_cpu

    placement = sglang_on_cpu(["rollout.engine=sglang"])
    if not any(o.startswith("rollout.server_python=") for o in placement):
        raise SystemExit("--part sglang needs the SGLang CPU venv: run `make sglang-cpu` first")
    modes = {}
    for k, extra in SGLANG_MODES.items():
        records, wall = launch(root, work / f"sglang-{k}", steps, "rollout.engine=sglang", *placement,
                               "trainer.eval_freq=10", *extra)  # fmt: skip
        pts = curve(records)
        row: dict = {"wall_s": wall, "steps_logged": sorted(r["step"] for r in records if r["step"] > 0) == list(range(1, steps + 1)),
                     "val_curve": pts, "aborted_frac_max": max(r.get("response/finish_abort_frac", 0.0) for r in records),
                     "staleness_max": max(r.get("async/staleness_max", 0) for r in records)}  # fmt: skip
        for key in SGLANG_MEANS:
            values = [r[key] for r in records[SKIP_WARMUP:] if key in r]
            if values:
                row[key] = statistics.mean(values)
        modes[k] = row
        print(f"  sglang {k}: val reward {pts[-1][2]:.3f} at step {pts[-1][0]}, {wall:.0f} s launch, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    return {"steps": steps, "eval_freq": 10, "placement": placement[:4], "modes": modes}


def print_tables(result: dict) -> None:
    tp = result.get("throughput")
    if tp:
        print(f"\nthroughput ({tp['repeats']} interleaved repeats, {tp['steps']} steps, median of steps "
              f"{tp['skip_warmup'] + 1}..{tp['steps'] - 1}); sync split: generate {tp['sync_generate_s']:.3f} s "
              f"({tp['sync_generate_share']:.0%}), rest {tp['sync_train_s']:.3f} s; limit {tp['limit']:.2f}x")
        print(f"{'mode':10} {'s/step':>7} {'samples/s':>10} {'speed-up':>9} {'of limit':>9} {'trainer own s':>14} "
              f"{'old lp s':>9} {'trainer busy':>13} {'engine busy':>12} {'staleness':>10}")
        for name, row in tp["modes"].items():
            busy = {s: f"{1 - row[f'async/{s}_idle_frac']:.0%}" if f"async/{s}_idle_frac" in row else "-" for s in ("trainer", "engine")}
            share = "-" if name == "k0" else f"{row['share_of_limit']:.0%}"
            stale = f"{row['async/staleness_mean']:.2f}" if "async/staleness_mean" in row else "0"
            print(f"{name:10} {row['step_s']:7.3f} {row['samples_per_s']:10.0f} {row['speedup']:9.2f} {share:>9} "
                  f"{row['train_s']:14.3f} {row.get('time/old_logprobs_s', 0.0):9.3f} {busy['trainer']:>13} "
                  f"{busy['engine']:>12} {stale:>10}")  # fmt: skip
    ln = result.get("learning")
    if ln:
        print(f"\nlearning ({ln['steps']} steps, seeds {ln['seeds']}); equal time budget {ln['equal_time_budget_s']:.0f} s")
        print(f"{'mode':10} {'val reward (last)':>18} {'per seed':>22} {'training s':>11} {'launch s':>9} "
              f"{'reward @ equal time':>20} {'first step >= 0.7':>18}")
        for name, row in ln["modes"].items():
            seeds = " ".join(f"{v:.2f}" for v in row["final_rewards"])
            print(f"{name:10} {row['final_reward_mean']:18.3f} {seeds:>22} {row['train_s_mean']:11.0f} {row['launch_s_mean']:9.0f} "
                  f"{row['reward_at_equal_time_mean']:20.3f} {str(row['first_step_mean_reward_ge_target']):>18}")  # fmt: skip


def print_sglang(sg: dict) -> None:
    print(f"\nsglang ({sg['steps']} steps, val every {sg['eval_freq']}; means over steps {SKIP_WARMUP + 1}..)")
    print(f"{'mode':10} {'val first':>9} {'val last':>9} {'mismatch':>9} {'mm stale0':>10} {'mm stale1':>10} "
          f"{'stale1 frac':>12} {'push s':>7} {'s/step':>7} {'aborted':>8} {'all steps':>10}")
    for name, row in sg["modes"].items():
        cells = [f"{row[k]:.4f}" if k in row else "-" for k in SGLANG_MEANS[:3]]
        print(f"{name:10} {row['val_curve'][0][2]:9.3f} {row['val_curve'][-1][2]:9.3f} {cells[0]:>9} {cells[1]:>10} "
              f"{cells[2]:>10} {row.get('async/staleness1_frac', 0.0):12.2f} {row.get('time/weight_sync_s', 0.0):7.3f} "
              f"{row.get('time/step_s', 0.0):7.2f} {row['aborted_frac_max']:8.2f} {str(row['steps_logged']):>10}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("throughput", "learning", "sglang", "all"), default="all")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=("k0", "k1", "k2"),
                        help="throughput: which modes (default k0 k1 k2; k0 always runs, the speed-ups are against it)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: fewer steps and repeats")
    parser.add_argument("--repeats", type=int, default=None, help="throughput: interleaved repeats (default 3, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="throughput: steps per run (default 30, quick 10)")
    parser.add_argument("--learn-steps", type=int, default=None, help="learning: steps per run (default 300, quick 40)")
    parser.add_argument("--seeds", type=int, default=None, help="learning: seeds per mode (default 3, quick 1)")
    parser.add_argument("--sglang-steps", type=int, default=None, help="sglang: steps per run (default 40, quick 6)")
    parser.add_argument("--learn-modes", nargs="+", choices=tuple(LEARN_MODES), default=tuple(LEARN_MODES),
                        help="learning: which runs (default all); results of others are kept from the last run")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (10 if args.quick else 30)
    learn_steps = args.learn_steps or (40 if args.quick else 300)
    seeds = tuple(range(1, (args.seeds or (1 if args.quick else 3)) + 1))
    result: dict = {"machine": describe(), "config": str(CONFIG.relative_to(ROOT)), "quick": args.quick}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-async-") as tmp:
        work = Path(tmp)
        if args.part in ("throughput", "all"):
            result["throughput"] = throughput(work / "demo", work, steps, repeats, tuple(args.modes))
        if args.part in ("learning", "all"):
            result["learning"] = learning(work / "demo", work, learn_steps, seeds, tuple(args.learn_modes))
        if args.part == "sglang":
            result["sglang"] = sglang_runs(work / "demo", work, args.sglang_steps or (6 if args.quick else 40))
    result["load_after"] = round(os.getloadavg()[0], 2)
    result["bench_wall_s"] = round(time.monotonic() - start)
    if OUT.is_file():
        keep_earlier(result, json.loads(OUT.read_text()), args.part)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result)
    if "sglang" in result:
        print_sglang(result["sglang"])
    print(f"\nload {result['machine']['load_avg_1m']} at the start, {result['load_after']} at the end; {result['bench_wall_s']} s")


def keep_earlier(result: dict, kept: dict, part: str) -> None:
    """What the file held before this run: earlier throughput results go to its "earlier" list
    (throughput is only compared within one interleaved run); one part run alone keeps the other
    part's last results, and learning runs of some modes keep the others' (then the equal-time
    reward is recomputed over all of them)."""
    result["earlier"] = kept.get("earlier", [])
    machines = {e["part"]: e["machine"] for e in kept.get("kept_from_earlier_run", [])}
    if "throughput" in result and "throughput" in kept:
        result["earlier"].append({"machine": machines.get("throughput", kept.get("machine")), "throughput": kept["throughput"]})
    earlier = kept.get("learning", {}).get("modes", {})
    replaced = {k: v for k, v in earlier.items() if k in result.get("learning", {}).get("modes", {})}
    if replaced:
        result["earlier"].append({"machine": machines.get("learning", kept.get("machine")), "learning_modes": replaced})
    if "learning" in result and set(earlier) - set(result["learning"]["modes"]):  # a subset of the runs
        ln = result["learning"]
        ln["modes_kept_from_earlier_run"] = sorted(set(earlier) - set(ln["modes"]))
        ln["modes"] = earlier | ln["modes"]
        ln["equal_time_budget_s"] = budget = min(m["train_s_mean"] for m in ln["modes"].values())
        for mode in ln["modes"].values():
            mode["reward_at_equal_time_mean"] = statistics.mean(at_time(c, budget) for c in mode["curves"])
    if part != "all":  # one part run alone keeps the other part's last results
        for other in ("throughput", "learning", "sglang"):
            if other not in result and other in kept:
                result[other] = kept[other]
                result.setdefault("kept_from_earlier_run", []).append({"part": other, "machine": machines.get(other, kept.get("machine"))})


if __name__ == "__main__":
    main()
