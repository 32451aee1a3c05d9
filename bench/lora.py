"""LoRA against full fine-tuning: a CPU train step, a weight push, and the planner's 72B memory.

Three measurements, each side of each interleaved with the other in one run:

1. **Train step.** Two ``PolicyWorker``s in one process (world size 1, gloo, fp32, 2 threads),
   built from the same random-init HF directory: ``full`` (every weight trains) and ``lora``
   (``ActorConfig.lora = LoRAConfig(rank 16, alpha 32, all-linear)``: the base frozen, only the
   adapters train). Default model: bench/train_step.py's ``cpu`` preset (8 layers, hidden 512,
   vocabulary 32k, ~55M parameters), 8 rows x 512 tokens (256 prompt + 256 response), micro-batch 2,
   the token-mean policy-gradient loss of train_step.py. One ``update`` is one optimizer step
   (forward + backward of every micro-batch, clipping, Adam). After one warm-up update each
   (Adam makes its state there), ``--repeats`` rounds of (full, lora); the seconds reported are
   the medians, and ``lora / full`` the median of the per-round ratios.
   Memory is counted in torch allocations, not RSS (both workers live in one process, so its RSS
   belongs to neither): ``states`` are the bytes of the distinct tensors each worker keeps between
   steps (weights, gradient buffers, the optimizer's state tensors; fp32 here, so Megatron's
   optimizer steps the parameters themselves: no master copies). ``step peak`` is the most bytes
   the CPU allocator held above what was live when the step began, during one more update run
   under torch's profiler (``profile_memory``: the running sum of its allocation and free events);
   ``peak`` = states + step peak. Trainable parameters: those with ``requires_grad``.
2. **Push.** The same two workers. ``merged``: the LoRA worker's ``export_weights`` (the bridge's
   HF export, the adapters merged into their linears), every tensor copied into fresh memory as
   a transport's bucket copy does: bytes and seconds of the whole export, which is what every
   transport then moves. ``full``: the same export of the full fine-tuning worker (nothing to
   merge: the cost of the merge is the difference). ``adapter``: ``peft_tensors()`` +
   ``write_peft_adapter`` into a temporary directory (the bytes of the files written, seconds;
   the page cache absorbs the write, no fsync). Interleaved (full, merged, adapter) for
   ``--repeats`` rounds after a warm-up of each; medians. No SGLang server runs: the time a server
   takes to load either push is not included.
3. **Planner.** ``make_plan`` (megarl/plan/) of configs/qwen72b_grpo.yaml (full fine-tuning,
   Qwen2.5-72B, 32 GPUs, TP 8 x PP 4) and configs/qwen72b_grpo_lora.yaml (LoRA rank 32 on every
   linear, 8 GPUs, TP 8): the policy's bytes per GPU by state, the update's peak
   (``TrainMemory.peak``), the heaviest training-GPU phase (``train_peak``) and the generation
   peak; and ``push_bytes`` of one push, merged (the config's) and adapter
   (``rollout.weight_sync.lora=adapter``). A model, not a measurement: no GPU runs.

Prints the tables and writes bench/results/lora.json and bench/results/lora.md (machine, date,
load before and after).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/lora.py [--repeats 5] [--preset cpu]
        [--rows 8] [--seq 512] [--micro 2] [--rank 16] [--out PATH] [--report-only]

A whole default run takes about 3 to 4 minutes here (2 cores, shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from logprob import build_model, make_batch  # noqa: E402  (bench/logprob.py)
from machine import describe  # noqa: E402  (bench/machine.py)
from train_step import PRESETS, pg_loss  # noqa: E402  (bench/train_step.py)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLAN_CONFIGS = {"full": "configs/qwen72b_grpo.yaml", "lora": "configs/qwen72b_grpo_lora.yaml"}
SIDES = ("full", "lora")
MIB, GIB = 1 << 20, 1 << 30


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of each measurement")
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS), help="model shape (bench/train_step.py)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512, help="tokens per row, half prompt, half response")
    ap.add_argument("--micro", type=int, default=2, help="micro-batch size")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "lora", help="results path without suffix (.json, .md)")
    ap.add_argument("--report-only", action="store_true", help="measure nothing: rewrite --out's .md from its .json")
    ap.add_argument("--plan-only", action="store_true", help="the planner's part again (a model, no measurement) into "
                    "--out's .json, after a change to the planner; the measured parts are kept")  # fmt: skip
    return ap.parse_args()


def build_workers(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The two sides, alive together so that their steps interleave."""
    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig, LoRAConfig, OptimizerConfig

    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=["all-linear"])
    workers = {}
    for side in SIDES:
        cfg = ActorConfig(micro_batch_size=args.micro, recompute="none", optimizer=OptimizerConfig(lr=1e-5),
                          lora=lora if side == "lora" else None)  # fmt: skip
        workers[side] = PolicyWorker(path, cfg, "float32", seed=0)
    return workers


def _distinct_bytes(tensors: Any) -> int:
    """Bytes of ``tensors``, each storage once (a gradient may alias its DDP buffer)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(worker: Any) -> dict[str, int]:
    """What the worker keeps between steps, by kind, and its trainable parameters."""
    from megarl.megatron_runtime.offload import model_grads, model_weights

    module, optimizer = worker.model.module, worker.trainer.optimizer
    states = []  # the optimizer's own state tensors (Adam's moments), not its parameter list
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        states += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    params = list(module.parameters())
    return {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
            "weights": _distinct_bytes(model_weights(module)), "grads": _distinct_bytes(model_grads(module)),
            "optimizer": _distinct_bytes(states)}  # fmt: skip


def timed_update(worker: Any, batch: Any) -> float:
    start = time.perf_counter()
    worker.update(batch, pg_loss)
    return time.perf_counter() - start


def step_peak_bytes(worker: Any, batch: Any) -> tuple[int, int]:
    """(most bytes allocated above the step's starting point, bytes still counted at its end)
    during one profiled update. The profiler drops the frees of blocks allocated before it
    started, so the peak can only be overstated, by at most the second number (a step that
    returns to where it began would end at 0)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        worker.update(batch, pg_loss)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak, running


def merged_export(worker: Any, gather_bytes: int) -> tuple[int, float]:
    """(bytes, seconds) of one whole HF export, each tensor copied as into a transport's bucket."""
    start = time.perf_counter()
    kept = [torch.empty_like(t).copy_(t) for _, t in worker.export_weights(gather_bytes=gather_bytes)]
    seconds = time.perf_counter() - start
    return sum(t.numel() * t.element_size() for t in kept), seconds


def adapter_push(worker: Any, directory: Path, base_model: str) -> tuple[int, float]:
    """(bytes written, seconds) of one adapter-mode push's payload: gather the adapters, write PEFT."""
    from megarl.models.lora import lora_of
    from megarl.weight_sync.lora_adapter import write_peft_adapter

    adapters = lora_of(worker.model.core)
    assert adapters is not None
    start = time.perf_counter()
    write_peft_adapter(directory, adapters.peft_tensors(), adapters.cfg, base_model)
    seconds = time.perf_counter() - start
    return sum(f.stat().st_size for f in directory.iterdir()), seconds


def measure_steps(workers: dict[str, Any], batch: Any, repeats: int) -> dict[str, Any]:
    """Seconds per update of each side (interleaved), its states and its step peak."""
    for worker in workers.values():
        worker.update(batch, pg_loss)  # warm-up: Adam's state is made in the first step
    times: dict[str, list[float]] = {side: [] for side in workers}
    loads = []  # the shared machine's 1-minute load after each round: how noisy the round was
    for r in range(repeats):
        for side, worker in workers.items():
            times[side].append(timed_update(worker, batch))
        loads.append(os.getloadavg()[0])
        print(f"  step round {r + 1}: " + ", ".join(f"{s} {t[-1]:.2f} s" for s, t in times.items())
              + f" (load {loads[-1]:.2f})", flush=True)  # fmt: skip
    out: dict[str, Any] = {"load_avg_1m_per_round": loads}
    for side, worker in workers.items():
        states = state_bytes(worker)
        states["step_peak"], states["step_end"] = step_peak_bytes(worker, batch)
        states["peak"] = states["weights"] + states["grads"] + states["optimizer"] + states["step_peak"]
        out[side] = {"seconds": times[side], "median_seconds": statistics.median(times[side]), **states}
    out["lora_over_full_seconds"] = statistics.median(b / a for a, b in zip(times["full"], times["lora"]))
    return out


def measure_pushes(workers: dict[str, Any], base_model: str, repeats: int, tmp: Path) -> dict[str, Any]:
    """Bytes and seconds of each push side (interleaved full / merged / adapter)."""
    from megarl.config.rollout_sections import WeightSyncConfig

    gather = int(WeightSyncConfig().gather_mb * MIB)  # rollout.weight_sync.gather_mb's default
    sides = {"full": lambda: merged_export(workers["full"], gather),
             "merged": lambda: merged_export(workers["lora"], gather),
             "adapter": lambda: adapter_push(workers["lora"], tmp / "adapter", base_model)}  # fmt: skip
    for push in sides.values():
        push()  # warm-up: peft and safetensors are imported on the first adapter push
    runs: dict[str, list[tuple[int, float]]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, push in sides.items():
            runs[side].append(push())
    out: dict[str, Any] = {side: {"bytes": r[0][0], "seconds": [s for _, s in r],
                                  "median_seconds": statistics.median(s for _, s in r)} for side, r in runs.items()}  # fmt: skip
    out["merged_over_adapter_bytes"] = out["merged"]["bytes"] / out["adapter"]["bytes"]
    out["merged_over_adapter_seconds"] = statistics.median(m / a for (_, m), (_, a) in zip(runs["merged"], runs["adapter"]))
    out["merged_over_full_seconds"] = statistics.median(m / f for (_, m), (_, f) in zip(runs["merged"], runs["full"]))
    return out


def plan_side(path: str, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The planner's policy memory per GPU (bytes) and one push's bytes for a config."""
    from megarl.config.loading import load_config
    from megarl.memory.residency import GENERATION_PHASES
    from megarl.plan.planner import make_plan
    from megarl.plan.push_model import push_bytes

    cfg = load_config(ROOT / path, list(overrides))
    plan = make_plan(cfg)
    memory, policy = plan.memory, plan.roles["policy"]
    assert memory is not None and memory.policy is not None
    train = memory.policy
    # train_peak's phase: the planner's rule (colocated, the generation phases are the engines')
    training = {p: b for p, b in memory.phases.items() if p not in GENERATION_PHASES}
    heaviest = max(training, key=training.__getitem__)
    assert training[heaviest] == memory.train_peak, (training, memory.train_peak)
    return {"config": path, "overrides": list(overrides), "gpus": cfg.cluster.world_size,
            "layout": f"tp {policy.tp} x pp {policy.pp} x dp {policy.dp}", "weights": train.weights,
            "grads": train.grads, "optimizer": train.optimizer, "activations": train.activations,
            "logits": train.logits, "head_grad": train.head_grad, "update_peak": train.peak,
            "train_peak": memory.train_peak, "train_peak_phase": heaviest, "rollout_peak": memory.rollout_peak,
            "phases": memory.phases, "train_peak_states": memory.residency[heaviest], "push_bytes": push_bytes(cfg, plan.arch)[0],
            "push_transport": plan.push.transport if plan.push else None,
            "push_estimate_seconds": plan.push.seconds if plan.push else None}  # fmt: skip


def measure_plan() -> dict[str, Any]:
    """Full fine-tuning and LoRA at 72B (merged pushes as configured), and LoRA's adapter pushes."""
    return {"full": plan_side(PLAN_CONFIGS["full"]), "lora": plan_side(PLAN_CONFIGS["lora"]),
            "lora_adapter": plan_side(PLAN_CONFIGS["lora"], ("rollout.weight_sync.lora=adapter",))}  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def step_table(steps: dict[str, Any]) -> list[str]:
    lines = ["| side | trainable params | step s (median) | weights MiB | grads MiB | optimizer MiB | step peak MiB | peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for side in SIDES:
        r = steps[side]
        lines.append(f"| {side} | {r['trainable']:,} of {r['params']:,} | {r['median_seconds']:.2f} | {_mib(r['weights'])} "
                     f"| {_mib(r['grads'])} | {_mib(r['optimizer'])} | {_mib(r['step_peak'])} | {_mib(r['peak'])} |")  # fmt: skip
    return lines


def push_table(pushes: dict[str, Any]) -> list[str]:
    what = {"full": "full fine-tuning: export", "merged": "LoRA merged: export (adapters merged)",
            "adapter": "LoRA adapter: peft_tensors + write_peft_adapter"}  # fmt: skip
    lines = ["| push | bytes | MiB | seconds (median) |", "|---|---:|---:|---:|"]
    for side, label in what.items():
        r = pushes[side]
        lines.append(f"| {label} | {r['bytes']:,} | {_mib(r['bytes'])} | {r['median_seconds']:.3f} |")
    return lines


def plan_table(plan: dict[str, Any]) -> list[str]:
    cols = {"full": "full fine-tuning", "lora": "LoRA (merged push)", "lora_adapter": "LoRA (adapter push)"}
    lines = ["| GiB per GPU | " + " | ".join(cols.values()) + " |", "|---|" + "---:|" * len(cols)]
    rows = [("GPUs (policy layout)", lambda r: f"{r['gpus']} ({r['layout']})")]
    rows += [(key, lambda r, k=key: _gib(r[k])) for key in ("weights", "grads", "optimizer", "activations", "logits",
                                                            "head_grad", "update_peak")]  # fmt: skip
    rows += [("train_peak (phase)", lambda r: f"{_gib(r['train_peak'])} ({r['train_peak_phase']})"),
             ("rollout_peak", lambda r: _gib(r["rollout_peak"])),
             ("push bytes (GiB, whole push)", lambda r: _gib(r["push_bytes"]))]  # fmt: skip
    rows += [(f"phase {p}", lambda r, p=p: _gib(r["phases"][p])) for p in ("policy_update", "weight_push")]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(plan[c]) for c in cols) + " |")
    return lines


def report(result: dict[str, Any]) -> str:
    """The markdown of bench/results/lora.md (also what is printed)."""
    m, a, steps, pushes = result["machine"], result["args"], result["steps"], result["pushes"]
    ratios = [b / f for f, b in zip(steps["full"]["seconds"], steps["lora"]["seconds"])]
    loads = steps["load_avg_1m_per_round"]
    return "\n".join([
        "# LoRA against full fine-tuning (bench/lora.py)", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, no GPU, Python {m['python']}, torch {m['torch']}, megatron-core "
        f"{m.get('megatron_core')}; {m['date']}, load average (1 min) {m['load_avg_1m']} at the start and "
        f"{result['load_avg_1m_after']:.2f} at the end (the machine is shared).", "",
        f"## Train step (CPU, fp32, {a['threads']} threads, world size 1)", "",
        f"Model: the `{a['preset']}` preset of bench/train_step.py ({result['model']}); {a['rows']} rows x {a['seq']} tokens, "
        f"micro-batch {a['micro']}; LoRA rank {a['rank']}, alpha {2 * a['rank']}, all-linear. {a['repeats']} interleaved "
        "rounds, medians. Memory: torch allocations (not RSS): weights, grads, optimizer = bytes of the tensors kept "
        "between steps (optimizer: Adam's state tensors); step peak = most bytes allocated above the step's start "
        "during a profiled update; peak = their sum.", "",
        *step_table(steps), "",
        f"LoRA / full step time: {steps['lora_over_full_seconds']:.2f} (median of per-round ratios; they ranged "
        f"{min(ratios):.2f} to {max(ratios):.2f}, load after each round {min(loads):.1f} to {max(loads):.1f}). The profiler "
        "drops frees of blocks older than the profiled step, so step peak may be overstated by at most the bytes its "
        f"count ended the step with: {_mib(steps['full']['step_end'])} MiB (full), {_mib(steps['lora']['step_end'])} "
        "MiB (lora).", "",
        "## Push payload (same model)", "",
        "Export: `export_weights`, every tensor copied once (what any transport moves). Adapter: `peft_tensors()` + "
        "`write_peft_adapter` to a temporary directory (bytes = files written). No SGLang server: the server-side "
        f"load time is not included. {a['repeats']} interleaved rounds, medians.", "",
        *push_table(pushes), "",
        f"Merged / adapter: {pushes['merged_over_adapter_bytes']:.1f}x the bytes, "
        f"{pushes['merged_over_adapter_seconds']:.1f}x the seconds; merged / full-fine-tuning export seconds: "
        f"{pushes['merged_over_full_seconds']:.2f} (the merge's cost).", "",
        "## Planner: Qwen2.5-72B GRPO, per GPU (megarl/plan, a model; no GPU ran)", "",
        f"`make_plan` of {PLAN_CONFIGS['full']} and {PLAN_CONFIGS['lora']} (the adapter column: the LoRA config with "
        "`rollout.weight_sync.lora=adapter`). update_peak = weights + grads + optimizer + activations + logits + "
        "head_grad (`TrainMemory.peak`); phase rows: the planner's total for a training GPU in that phase (its resident "
        "states, the phase's working memory, the processes' own memory); train_peak = the heaviest phase, generation aside; "
        "push bytes = one whole push (`push_bytes`), not per GPU."
        + (f" Made {result['plan_made']} (`--plan-only`, after a change to the planner)." if "plan_made" in result else ""), "",
        *plan_table(result["plan"]), ""])  # fmt: skip


def main() -> None:
    args = parse()
    if args.report_only:  # the table's wording changed, not the numbers
        args.out.with_suffix(".md").write_text(report(json.loads(args.out.with_suffix(".json").read_text())))
        return
    if args.plan_only:
        kept = json.loads(args.out.with_suffix(".json").read_text())
        kept["plan"] = measure_plan()
        kept["plan_made"] = describe()["date"]  # the planner's part is younger than the measurements
        args.out.with_suffix(".json").write_text(json.dumps(kept, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(report(kept))
        return
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29536"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="")  # fmt: skip
    info, start = describe(), time.perf_counter()
    shape = PRESETS[args.preset]
    result: dict[str, Any] = {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "model": ", ".join(f"{k} {v}" for k, v in shape.items())}  # fmt: skip
    result["plan"] = measure_plan()  # first: torch-free, and it needs no model
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"],
                           shape["vocab"], ffn=shape["ffn"], head_dim=shape["head_dim"], max_positions=args.seq)  # fmt: skip
        workers = build_workers(path, args)
        half = args.seq // 2
        batch = make_batch(args.rows, half, args.seq - half, shape["vocab"])
        print(f"train steps ({args.repeats} rounds):", flush=True)
        result["steps"] = measure_steps(workers, batch, args.repeats)
        print(f"pushes ({args.repeats} rounds):", flush=True)
        result["pushes"] = measure_pushes(workers, str(path), args.repeats, Path(tmp))
        for worker in workers.values():
            worker.close()
    result["load_avg_1m_after"] = os.getloadavg()[0]
    # The whole process (both workers and every step): not a per-side figure.
    result["process_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["wall_seconds"] = time.perf_counter() - start
    text = report(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(f"wrote {args.out.with_suffix('.json')} and .md ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
