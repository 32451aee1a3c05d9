"""The CPU demo against Hugging Face TRL's GRPOTrainer on the same job, side by side.

    .venv/bin/python bench/vs_trl.py [--steps 500] [--seeds 1 2 3] [--eval-every 100]

Both sides load the same HF model (the demo's tiny random-init Qwen2, built once under
outputs/bench_vs_trl/model), train on the same parquet rows in the same order (megarl's sampler
order for the seed, handed to TRL with its shuffle off), score with the same reward file
(megarl/rewards/reverse_digits.py) on the same decoded text, and use the same sampling, learning
rate, Adam, clipping, KL coefficient (k3 in the loss) and number of steps. Runs are interleaved:
for each seed every side runs once, the order alternating between seeds. Per run: the median
step time and phase times (megarl's time/*_s from metrics.jsonl; TRL's trainer methods timed by
bench/vs_trl_side.py), the wall time from the command's start to its exit, the peak RSS and PSS
summed over the run's process tree (/proc/<pid>/smaps_rollup sampled every 0.5 s) and the
held-out greedy reward at step 0 and every --eval-every steps.

TRL runs in its own venv (ci/trl/build-venv.sh, built on first use, cached outside the checkout;
`make trl-venv`), never megarl's. Writes bench/results/vs_trl.json and .md (--results elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from machine import describe  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
SKIP_WARMUP = 3  # the first steps pay one-off costs (allocations, process starts)
CONFIG = ROOT / "configs" / "tiny_grpo.yaml"
# The sides: a name -> megarl demo overrides (None: TRL). "megarl (check every push)": the
# post-push check as before rollout.weight_sync.check_logprobs_every existed; "baseline": the
# demo run from another checkout (--baseline, e.g. a worktree of an earlier commit).
# "megarl (in-process)": `megarl launch --in-process` on the demo's model and data: one process,
# no Ray, one policy rank (DP=1), the rewards' worker processes as in the demo.
SIDES: dict[str, list[str] | None] = {
    "megarl": [],
    "megarl (check every push)": ["rollout.weight_sync.check_logprobs_every=1"],
    "megarl (in-process)": ["cluster.gpus_per_node=1"],
    "baseline": [],
    "trl": None,
}
RUN_NAMES = {"megarl": "megarl", "megarl (check every push)": "megarl-check1", "megarl (in-process)": "megarl-inproc",
             "baseline": "baseline", "trl": "trl"}  # fmt: skip


def trl_python() -> Path:
    """The TRL venv's interpreter, built (a few minutes, once) when missing."""
    out = subprocess.run(["bash", str(ROOT / "ci" / "trl" / "build-venv.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def settings() -> dict:
    """The job both sides run: the demo config's values, read from it (not restated here)."""
    from megarl.config.loading import load_config

    cfg = load_config(CONFIG)
    opt = cfg.actor.optimizer
    return {"lr": opt.lr, "weight_decay": opt.weight_decay, "betas": list(opt.betas), "eps": opt.eps, "clip_grad": opt.clip_grad,
            "prompts_per_step": cfg.data.prompts_per_step, "n": cfg.rollout.n, "micro_batch": cfg.actor.micro_batch_size,
            "max_new_tokens": cfg.rollout.sampling.max_new_tokens, "temperature": cfg.rollout.sampling.temperature,
            "kl_coef": cfg.algorithm.kl.coef, "clip": cfg.algorithm.clip.low}  # fmt: skip


def rows_in_order(path: Path, seed: int, per_step: int, steps: int) -> list[dict]:
    """The training prompts megarl's sampler draws for ``seed``, step after step."""
    import pyarrow.parquet as pq

    from megarl.data.sampler import MixtureSampler

    table = pq.read_table(path).to_pylist()
    sampler = MixtureSampler([len(table)], batch_size=per_step, seed=seed)
    return [_row(table[i]) for _ in range(steps) for _, i in sampler.next_indices()]


def _row(r: dict) -> dict:
    return {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"]}


class TreeMemory:
    """Peak RSS and PSS (bytes) summed over ``pid`` and its descendants, sampled in a thread, and
    the CPU time they used (user + system, each process's last sample with its reaped children's)."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_rss = self.peak_pss = self.peak_procs = 0
        self.at_peak: dict[str, float] = {}  # process role (process_role) -> PSS GiB summed, at the PSS peak
        self.cpu_ticks: dict[int, int] = {}  # pid -> its CPU time and its reaped children's, clock ticks, last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = self._tree()
            rss = pss = 0
            names: dict[str, float] = {}
            for pid in pids:
                try:
                    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
                    name = self.process_role(pid)
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                self.cpu_ticks[pid] = sum(int(t) for t in stat[11:15])  # utime, stime, cutime, cstime
                fields = dict(line.split(":", 1) for line in text.splitlines()[1:])
                rss += int(fields["Rss"].split()[0]) << 10
                own = int(fields["Pss"].split()[0]) << 10
                pss += own
                names[name] = names.get(name, 0.0) + own / 2**30
            if pss > self.peak_pss:
                self.at_peak = names
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_procs = max(self.peak_procs, len(pids))

    def process_role(self, pid: int) -> str:
        """What a process of the tree is: the command the bench started, megarl's driver, the reward
        workers' forkserver and workers, multiprocessing's resource tracker, else its name (Ray's
        processes: ``ray::<what>``, gcs_server, raylet)."""
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in argv)
        if pid == self.pid:
            return "the command"
        if "-m megarl.cli" in text:
            return "megarl driver"
        if "forkserver" in text:
            return "reward workers (forkserver)"
        if "resource_tracker" in text:
            return "resource tracker"
        if "PR_SET_PDEATHSIG" in text:  # megarl/plan/import_check_child.py's code, on its command line
            return "pre-launch import check"
        if "site-packages/ray/" in text:  # Ray's Python processes: dashboard, log monitor, autoscaler monitor
            script = next((a.decode(errors="replace") for a in argv if a.endswith(b".py")), "ray")
            return f"ray ({Path(script).stem})"
        return Path(f"/proc/{pid}/comm").read_text().strip()

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree


# Where a megarl demo run's end-to-end time goes: the first output line that contains each text,
# in the order they come (seconds from the command's start, from the stamped log).
MILESTONES = (
    ("checks", "starting an embedded Ray"),  # imports, config, the pre-launch checks
    ("ray", "Started a local Ray instance"),  # Ray's processes
    ("ranks", "rank(s) ready"),  # the policy ranks: imports, policy, reference, engine, optimizer
    ("first_push", "training steps"),  # rewards, first weight push and check, validation at step 0
    ("trained", "checkpoint: saved step"),  # the steps, validations and the last step's checkpoint
    ("plotted", "curves:"),  # Ray and the workers shut down, the curves drawn
)


def run_measured(cmd: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run ``cmd`` (in ``cwd``) to its end; wall time, the process tree's peak memory, and its
    output in ``log``, each line stamped with the seconds since the start."""
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env, text=True)
        memory = TreeMemory(proc.pid)
        reader = threading.Thread(target=_stamp, args=(proc.stdout, out, start), daemon=True)
        reader.start()
        rc = proc.wait()  # the command's end (processes it left behind may hold its output a while longer)
        wall = time.perf_counter() - start
        memory.stop()
        reader.join(timeout=60)
    if rc != 0:
        raise SystemExit(f"error: {' '.join(cmd[:3])} ... exited {rc}; see {log}")
    return {"wall_s": wall, "peak_rss_gib": memory.peak_rss / 2**30,
            "peak_pss_gib": memory.peak_pss / 2**30, "processes": memory.peak_procs, "cpu_s": memory.cpu_s,
            "pss_at_peak_gib": dict(sorted(memory.at_peak.items(), key=lambda kv: -kv[1]))}


def _stamp(lines: Any, out: Any, start: float) -> None:
    for line in lines:
        out.write(f"{time.perf_counter() - start:8.2f} {line}")


def milestones(log: Path) -> dict[str, float]:
    """Seconds from the start to each of MILESTONES found in a stamped log."""
    found: dict[str, float] = {}
    for line in log.read_text().splitlines():
        stamp, _, text = line.strip().partition(" ")
        for name, mark in MILESTONES:
            if name not in found and mark in text:
                found[name] = float(stamp)
    return found


def run_megarl(work: Path, run: Path, seed: int, args: argparse.Namespace, extra: list[str], checkout: Path = ROOT) -> dict:
    overrides = [f"trainer.total_steps={args.steps}", f"trainer.seed={seed}", f"data.seed={seed}",
                 f"trainer.eval_freq={args.eval_every}", "trainer.eval_before_train=true", "trainer.save_freq=0",
                 "trainer.loggers=[jsonl]", "trainer.resume=disable", f"trainer.output_dir={run}", *extra]  # fmt: skip
    # The checkout's megarl: `python -c` puts the working directory first on sys.path, so the
    # command runs there (PYTHONPATH alone would lose to this checkout as the working directory).
    command = ["demo", *overrides, "--root", str(work)]
    if "cluster.gpus_per_node=1" in extra:  # the in-process side: launch on the demo's model and data
        data = work / "data"
        command = ["launch", "--in-process", str(CONFIG), f"model.path={work / 'model'}", f"data.train_files=[{data / 'train.parquet'}]",
                   f"data.val_files=[{data / 'val.parquet'}]", *overrides]  # fmt: skip
    cmd = [sys.executable, "-c", "import sys; from megarl.cli import main; sys.exit(main())", *command]
    measured = run_measured(cmd, run.with_suffix(".log"), env=os.environ | {"PYTHONPATH": str(checkout)}, cwd=checkout)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r and r.get("step", 0) >= 1]
    evals = {r["step"]: r["val/reward/mean"] for r in records if "val/reward/mean" in r}
    return measured | summarize(steps) | {"held_out": evals, "milestones_s": milestones(run.with_suffix(".log"))}


def run_trl(python: Path, work: Path, run: Path, seed: int, args: argparse.Namespace) -> dict:
    s = settings()
    job = {"model": str(work / "model"), "reward_file": str(ROOT / "megarl" / "rewards" / "reverse_digits.py"),
           "seed": seed, "steps": args.steps, "eval_every": args.eval_every, "threads": args.trl_threads, "settings": s,
           "train_rows": rows_in_order(work / "data" / "train.parquet", seed, s["prompts_per_step"], args.steps),
           "val_rows": _val_rows(work)}  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    (run / "job.json").write_text(json.dumps(job))
    cmd = [str(python), str(ROOT / "bench" / "vs_trl_side.py"), "--job", str(run / "job.json"), "--out", str(run)]
    measured = run_measured(cmd, run.with_suffix(".log"), env=os.environ | {"PYTHONPATH": "", "OMP_NUM_THREADS": str(args.trl_threads)})
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {json.loads(line)["step"]: json.loads(line)["val/reward/mean"] for line in (run / "eval.jsonl").read_text().splitlines()}
    return measured | summarize(steps) | {"held_out": evals}


def _val_rows(work: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [_row(r) for r in pq.read_table(work / "data" / "val.parquet").to_pylist()]


def summarize(steps: list[dict]) -> dict:
    """Median step time and phase times over the steps after the warm-up (the last step of a
    megarl run also writes its final checkpoint: left out)."""
    kept = steps[SKIP_WARMUP:-1] or steps
    phases = sorted({k for r in kept for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"})
    medians = {p.removeprefix("time/").removesuffix("_s"): statistics.median(r.get(p, 0.0) for r in kept) for p in phases}
    return {"steps": len(steps), "step_s": statistics.median(r["time/step_s"] for r in kept),
            "phases_s": {k: v for k, v in medians.items() if v > 0}}


# What TRL's GRPOTrainer does not do as megarl's demo does, and why the job is still the same.
UNMATCHED = [
    ("process layout", "megarl: Ray, 2 Megatron ranks (DP=2), the torch engine in a rank, rewards in 2 worker processes; TRL: "
     "one process generating with the model it trains", "the layout is what is measured"),
    ("weight push and post-push check", "TRL generates with the trained model itself: nothing to push or check",
     "megarl's rollout engine is a separate copy of the weights (the SGLang path at scale)"),
    ("dual clip (algorithm.clip.dual_c 3)", "TRL has none", "one update per step (ratio 1): never active"),
    ("random streams", "sampling draws differ (megarl seeds each sample from trainer.seed)", "same prompts, same "
     "initial weights; held-out rewards are compared over seeds"),
    ("threads", "TRL: --trl-threads torch threads in one process; megarl: as `make demo` sets them", "on a loaded machine "
     "TRL's default of all cores spins against the other jobs (1 to 18 s a step against 0.4 s with 1 thread)"),
    ("checkpoints, loggers and curves", "megarl: trainer.save_freq=0, loggers [jsonl] (the demo saves every 200 steps, "
     "logs to the console and tensorboard), and the last step's checkpoint, which megarl always writes, and the curves "
     "`megarl demo` draws; TRL: save_strategy no, no plot", "both are in megarl's end to end (the spans table: the loop's "
     "rest and shutdown)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--sides", nargs="+", default=["megarl", "trl"], choices=list(SIDES))
    parser.add_argument("--baseline", type=Path, help="the checkout the baseline side runs megarl from")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="torch threads of the TRL process (default 1: on a loaded 2-core machine torch's 2 OpenMP threads "
                        "spin against the other jobs, 1 to 18 s a step against 0.4 s with 1; on an idle machine use the cores)")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_vs_trl", help="model, data and runs")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="where vs_trl.json and .md go")
    parser.add_argument("--rerender", action="store_true", help="only write vs_trl.md again from --results' vs_trl.json")
    parser.add_argument("--summary", type=Path, help="with --rerender: a Markdown file whose text is kept in vs_trl.json "
                        "and heads vs_trl.md (the reading of a run, written after it)")  # fmt: skip
    args = parser.parse_args()
    if args.rerender:
        return rerender(args.results, args.summary)
    if "baseline" in args.sides and (args.baseline is None or not (args.baseline / "megarl" / "cli.py").is_file()):
        raise SystemExit(f"error: --sides baseline needs --baseline, a megarl checkout (got {args.baseline})")
    from megarl.commands.demo import prepare_demo

    prepare_demo(args.work)
    python = trl_python() if "trl" in args.sides else None
    before = describe()
    runs: list[dict] = []
    for k, seed in enumerate(args.seeds):
        order = args.sides if k % 2 == 0 else args.sides[::-1]  # interleaved: alternate who goes first
        for side in order:
            run = args.work / "runs" / f"{RUN_NAMES[side]}-seed{seed}"
            extra = SIDES[side]
            if extra is None:
                assert python is not None
                result = run_trl(python, args.work, run, seed, args)
            else:
                checkout = args.baseline if side == "baseline" else ROOT
                result = run_megarl(args.work, run, seed, args, extra, checkout.resolve())
            runs.append({"side": side, "seed": seed, "load_avg_1m": round(os.getloadavg()[0], 2)} | result)
            print(f"{side:28} seed {seed}: {result['step_s'] * 1e3:.0f} ms/step, {result['wall_s']:.0f} s, "
                  f"PSS {result['peak_pss_gib']:.2f} GiB, held-out {result['held_out']}", flush=True)
    write_results(args, before, runs)


def write_results(args: argparse.Namespace, machine: dict, runs: list[dict]) -> None:
    sides = [s for s in args.sides if any(r["side"] == s for r in runs)]
    table = {s: aggregate([r for r in runs if r["side"] == s]) for s in sides}
    out = {"machine": machine, "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "steps": args.steps, "seeds": args.seeds,
           "trl_threads": args.trl_threads, "baseline": baseline_commit(args.baseline), "settings": settings(), "sides": table, "runs": runs, "unmatched": UNMATCHED}  # fmt: skip
    if "trl" in table:
        out["ratios_to_trl"] = {s: {k: table[s][k] / table["trl"][k] for k in ("step_s", "wall_s", "peak_pss_gib")}
                                for s in sides if s != "trl"}  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.results / "vs_trl.md").write_text(markdown(out))
    print(markdown(out))


def baseline_commit(checkout: Path | None) -> str | None:
    if checkout is None:
        return None
    out = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    return f"{checkout}: {out.stdout.strip()[:100]}" if out.stdout.strip() else str(checkout)


def aggregate(runs: list[dict]) -> dict:
    """Medians over the seeds' runs; the held-out reward as the mean over seeds per step."""
    med = {k: statistics.median(r[k] for r in runs) for k in ("step_s", "wall_s", "peak_rss_gib", "peak_pss_gib", "processes")}
    if all("cpu_s" in r for r in runs):  # the cores the run kept busy on average (results before it have none)
        med["cores_busy"] = statistics.median(r["cpu_s"] / r["wall_s"] for r in runs)
    phases = sorted({p for r in runs for p in r["phases_s"]})
    med["phases_s"] = {p: statistics.median(r["phases_s"].get(p, 0.0) for r in runs) for p in phases}
    steps = sorted({int(s) for r in runs for s in r["held_out"]})
    med["held_out"] = {s: statistics.mean(r["held_out"][s] for r in runs if s in r["held_out"]) for s in steps}
    # What is not the steps: the wall time less the run's steps at its median step time.
    med["fixed_s"] = statistics.median(r["wall_s"] - r["steps"] * r["step_s"] for r in runs)
    spans = [_spans(r) for r in runs if r.get("milestones_s")]
    if spans:
        med["spans_s"] = {k: statistics.median(sp.get(k, 0.0) for sp in spans) for k in spans[0]}
    return med


def _spans(run: dict) -> dict[str, float]:
    """Seconds between consecutive MILESTONES of a megarl run (each named after the one it ends
    at), the exit last; the steps' median time taken out of "trained"."""
    marks, out, before = run["milestones_s"], {}, 0.0
    for name, _ in MILESTONES:
        if name in marks:
            out[name] = marks[name] - before
            before = marks[name]
    out["exit"] = run["wall_s"] - before
    if "trained" in out:
        out["steps"] = run["steps"] * run["step_s"]
        out["trained"] -= out["steps"]
    return out


def markdown(out: dict) -> str:
    m, sides = out["machine"], out["sides"]
    lines = ["# megarl's CPU demo against TRL's GRPOTrainer (bench/vs_trl.py)\n"]
    if out.get("summary"):
        lines += [out["summary"] + "\n"]
    lines += [f"{m['date']}, {m['cpu']}, {m['cores']} cores, torch {m.get('torch')}, load (1 min) {m['load_avg_1m']} at the start, "
              f"{out['load_avg_1m_at_end']} at the end (the bench's own runs make about 1 to 2; more is other jobs: the "
              f"per-run table has each run's). {out['steps']} steps, seeds {out['seeds']}, the sides interleaved; medians over "
              f"the seeds of each run's median step. TRL's torch threads: {out['trl_threads']}. Baseline: {out['baseline']}.\n",
              "| side | s/step | end to end s | peak RSS GiB | peak PSS GiB | processes | cores busy |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {s} | {v['step_s']:.3f} | {v['wall_s']:.0f} | {v['peak_rss_gib']:.2f} | {v['peak_pss_gib']:.2f} | {v['processes']:.0f} | "
              + (f"{v['cores_busy']:.2f} |" if "cores_busy" in v else "- |") for s, v in sides.items()]  # fmt: skip
    lines += ["", "cores busy: the CPU time of the run's processes (user and system) over its wall time, start to exit."]
    if "ratios_to_trl" in out:
        lines += ["", "Ratios to TRL (target: s/step <= 1.0, end to end <= 1.2, PSS <= 2):", ""]
        lines += [f"- {s}: s/step {r['step_s']:.2f}x, end to end {r['wall_s']:.2f}x, PSS {r['peak_pss_gib']:.2f}x"
                  for s, r in out["ratios_to_trl"].items()]
    lines += seed_table(out)
    lines += startup_table(sides)
    names = sorted({p for v in sides.values() for p in v["phases_s"]})
    lines += ["", "Phase medians, ms (megarl: time/<phase>_s; TRL: generate_and_score holds generate, reward and ref_logprobs; "
              "update is the rest of its step):", "", "| phase | " + " | ".join(sides) + " |", "|---" * (len(sides) + 1) + "|"]  # fmt: skip
    lines += [f"| {p} | " + " | ".join(f"{v['phases_s'].get(p, 0.0) * 1e3:.1f}" for v in sides.values()) + " |" for p in names]
    steps = sorted({s for v in sides.values() for s in v["held_out"]})
    lines += ["", "Held-out greedy reward (mean over seeds):", "", "| side | " + " | ".join(f"step {s}" for s in steps) + " |",
              "|---" * (len(steps) + 1) + "|"]  # fmt: skip
    lines += [f"| {s} | " + " | ".join(f"{v['held_out'].get(k, float('nan')):.3f}" for k in steps) + " |" for s, v in sides.items()]
    lines += readings(out)
    lines += ["", "Settings TRL does not match, and why the comparison holds:", ""]
    lines += [f"- {what}: {how} ({why})." for what, how, why in out["unmatched"]]
    return "\n".join(lines) + "\n"


def seed_table(out: dict) -> list[str]:
    """Each run (the load at its end), and per seed each side's ratios to TRL's run of that seed
    (runs of one seed ran back to back: the pair shares the load better than the medians do)."""
    lines = ["", "Per run (load: 1-minute load average at the run's end; ratios to TRL's run of the same seed):", "",
             "| side | seed | load | s/step | end to end s | s/step ratio | end to end ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    trl = {r["seed"]: r for r in out["runs"] if r["side"] == "trl"}
    for r in out["runs"]:
        t = trl.get(r["seed"])
        ratios = f"{r['step_s'] / t['step_s']:.2f}x | {r['wall_s'] / t['wall_s']:.2f}x" if t and r["side"] != "trl" else "- | -"
        lines.append(f"| {r['side']} | {r['seed']} | {r['load_avg_1m']} | {r['step_s']:.3f} | {r['wall_s']:.0f} | {ratios} |")
    return lines


# What each span of startup_table holds.
SPANS = {"checks": "imports, config, pre-launch checks", "ray": "Ray's processes start",
         "ranks": "training data read; the policy ranks: imports, policy, reference, engine, optimizer",
         "first_push": "reward workers, first weight push and its check, validation at step 0",
         "steps": "the steps (count x median step)", "trained": "the rest of the training loop: validations, "
         "slower first steps, the last step's checkpoint", "plotted": "Ray and the workers shut down, the curves drawn",
         "exit": "the interpreter's exit"}  # fmt: skip


def startup_table(sides: dict) -> list[str]:
    """End to end, span by span (megarl sides, from their stamped logs), and each side's fixed part."""
    lines = ["", "End to end, s (medians over the seeds; fixed: the wall time less steps x median step):", "",
             "| side | end to end | fixed | " + " | ".join(SPANS) + " |", "|---" * (len(SPANS) + 3) + "|"]  # fmt: skip
    for side, v in sides.items():
        spans = v.get("spans_s", {})
        lines.append(f"| {side} | {v['wall_s']:.1f} | {v['fixed_s']:.1f} | "
                     + " | ".join(f"{spans[k]:.1f}" if k in spans else "-" for k in SPANS) + " |")  # fmt: skip
    lines += ["", "Spans: " + "; ".join(f"{k}: {what}" for k, what in SPANS.items()) + "."]
    return lines


def readings(out: dict) -> list[str]:
    """What the numbers say about the targets and the remaining gaps (from the numbers above)."""
    sides = out["sides"]
    lines = ["", "Readings:", ""]
    if "baseline" in sides and "megarl" in sides:
        new, old = sides["megarl"], sides["baseline"]
        by_seed = {(r["side"], r["seed"]): r["held_out"] for r in out["runs"]}
        same = all(by_seed.get(("baseline", seed)) == by_seed.get(("megarl", seed)) for seed in out["seeds"])
        lines.append(f"- megarl against the baseline checkout: {new['step_s'] * 1e3:.0f} against {old['step_s'] * 1e3:.0f} ms a step "
                     f"({new['step_s'] / old['step_s'] - 1:+.0%}); the weight_sync phase {new['phases_s'].get('weight_sync', 0) * 1e3:.0f} "
                     f"against {old['phases_s'].get('weight_sync', 0) * 1e3:.0f} ms. Held-out rewards "
                     f"{'equal at every step and seed: the cuts do not change what is trained' if same else 'differ'}.")  # fmt: skip
    if "trl" in sides and "megarl" in sides:
        lines += _gaps(out, sides["megarl"], sides["trl"])
    return lines


def _ms(side: dict, phase: str) -> float:
    return side["phases_s"].get(phase, 0.0) * 1e3


def _gaps(out: dict, new: dict, trl: dict) -> list[str]:
    """Each remaining gap to TRL, with its share and what closing it would take."""
    step_gap = (new["step_s"] - trl["step_s"]) * 1e3
    push = _ms(new, "weight_sync")
    named = sum(_ms(new, p) for p in ("generate", "reward", "ref_logprobs", "old_logprobs", "advantages", "policy_update"))
    rest = new["step_s"] * 1e3 - named - push
    lines = [f"- s/step: {new['step_s'] * 1e3:.0f} against {trl['step_s'] * 1e3:.0f} ms ({step_gap:+.0f} ms). Phase by phase: "
             f"policy update, the reference's log-probs computed in its pass, {_ms(new, 'policy_update'):.0f} ms against TRL's "
             f"update {_ms(trl, 'update'):.0f} + its reference log-probs {_ms(trl, 'ref_logprobs'):.0f}; generation "
             f"{_ms(new, 'generate'):.0f} against {_ms(trl, 'generate'):.0f}; reward {_ms(new, 'reward'):.0f} against "
             f"{_ms(trl, 'reward'):.0f}; megarl's weight push {push:.0f} ms has no TRL counterpart (TRL generates with the "
             "model it trains; megarl's engine is a copy of the weights, as SGLang's is at scale: a Ray call to both ranks, "
             "the export, its exact check and, every 10th push, the post-push check); the rest of megarl's step "
             f"(Ray round trips, the controller's batch work) {rest:.0f} ms. Without the push the step would be "
             f"{(new['step_s'] * 1e3 - push) / (trl['step_s'] * 1e3):.2f}x TRL's: closing the push takes an engine that reads "
             "the policy's own parameters (TP=PP=1, in the rank), which gives up the separate copy the post-push check "
             "compares with."]  # fmt: skip
    spans = new.get("spans_s", {})
    fixed_gap = new["fixed_s"] - trl["fixed_s"]
    lines.append(f"- End to end: {new['wall_s']:.0f} against {trl['wall_s']:.0f} s; the steps' part "
                 f"{new['wall_s'] - new['fixed_s']:.0f} against {trl['wall_s'] - trl['fixed_s']:.0f} s, the fixed part "
                 f"{new['fixed_s']:.0f} against {trl['fixed_s']:.0f} s ({fixed_gap:+.0f} s). megarl's fixed part (spans "
                 f"table): pre-launch checks {spans.get('checks', 0):.1f} s (the imports and the tokenizer the prompt "
                 f"length check needs), Ray's start {spans.get('ray', 0):.1f} s, the ranks {spans.get('ranks', 0):.1f} s (each "
                 f"imports torch and megatron-core and builds policy, reference, engine and optimizer), rewards, first push "
                 f"and validation {spans.get('first_push', 0):.1f} s, the loop's rest {spans.get('trained', 0):.1f} s (the last "
                 f"step's checkpoint, which megarl always writes and TRL's save_strategy no does not), shutdown and the "
                 f"curves {spans.get('plotted', 0):.1f} s. Ray's start and the 2 rank processes are the process layout "
                 "(Ray, DP=2): closing them takes an in-process CPU demo without Ray, which gives up the rewards' process "
                 "isolation; the checkpoint is what a user resumes from.")  # fmt: skip
    first = next(r for r in out["runs"] if r["side"] == "megarl")
    where = ", ".join(f"{name} {gib:.2f}" for name, gib in list(first.get("pss_at_peak_gib", {}).items())[:6])
    ratio = new["peak_pss_gib"] / trl["peak_pss_gib"]
    verdict = ("The target (2x) is met." if ratio <= 2 else "The target (2x) is not met: each process imports torch (and "
               "the ranks megatron-core); closing it takes fewer processes (one rank, no Ray: `megarl launch --in-process`), "
               "which gives up the DP=2 layout the demo shows and Ray's process isolation.")  # fmt: skip
    lines.append(f"- Memory: megarl's tree of {new['processes']:.0f} processes holds {ratio:.1f}x TRL's single process in "
                 f"PSS (GiB by process at the peak, seed {first['seed']}: {where}). {verdict}")  # fmt: skip
    lines += _in_process(out, trl)
    lines.append(f"- TRL ran with {out['trl_threads']} torch thread(s) (see threads below). An idle machine with TRL on "
                 "both cores (--trl-threads 2) is not measured in this file.")  # fmt: skip
    return lines


def _in_process(out: dict, trl: dict) -> list[str]:
    """The in-process side against TRL: one process as TRL's, so what is left is megarl's own."""
    side = out["sides"].get("megarl (in-process)")
    if side is None:
        return []
    run = next(r for r in out["runs"] if r["side"] == "megarl (in-process)")
    where = ", ".join(f"{name} {gib:.2f}" for name, gib in list(run.get("pss_at_peak_gib", {}).items())[:5])
    busy = f", {side['cores_busy']:.2f} cores busy against TRL's {trl['cores_busy']:.2f}" if "cores_busy" in side and "cores_busy" in trl else ""
    return [f"- In process (`megarl launch --in-process`: one policy rank, no Ray, rewards in 2 worker processes): "
            f"{side['step_s'] * 1e3:.0f} ms a step ({side['step_s'] / trl['step_s']:.2f}x TRL's), {side['wall_s']:.0f} s end "
            f"to end ({side['wall_s'] / trl['wall_s']:.2f}x), PSS {side['peak_pss_gib']:.2f} GiB "
            f"({side['peak_pss_gib'] / trl['peak_pss_gib']:.1f}x; by process at the peak, seed {run['seed']}: {where}){busy}."]


def rerender(results: Path, summary: Path | None = None) -> None:
    """vs_trl.md again from the vs_trl.json of an earlier run (the readings as this file writes
    them); ``summary``'s text, when given, is stored in the JSON and heads the page from then on."""
    out = json.loads((results / "vs_trl.json").read_text())
    out["unmatched"] = UNMATCHED
    if summary is not None:
        out["summary"] = summary.read_text().strip()
        (results / "vs_trl.json").write_text(json.dumps(out, indent=2) + "\n")
    for side in out["sides"].values():  # JSON's keys are strings: the steps again as numbers, in order
        side["held_out"] = {int(k): v for k, v in side["held_out"].items()}
    (results / "vs_trl.md").write_text(markdown(out))


if __name__ == "__main__":
    main()
