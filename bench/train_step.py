"""Training-step throughput and MFU of PolicyWorker.update (one optimizer step, one process).

One step = forward + backward over every micro-batch of the batch, gradient clipping and the
Adam step, through Megatron's schedule with a token-mean policy-gradient loss. MFU:

    flops = 6 x params x tokens + 12 x layers x q_dim x seq^2 x rows
    MFU   = flops / step_seconds / peak

``params`` excludes the input embedding table (a lookup, no matmul; the LM head counts);
``q_dim`` is query heads x head size. The worker runs the LM head at response positions only
(half the tokens here), so the formula counts more than is executed: ``mfu_executed`` counts
the LM head on response tokens only. The attention term counts the whole ``seq^2`` score
matrix, as PaLM's MFU does; a causal kernel computes about half of it: ``mfu_causal`` counts
that half (the one to compare with frameworks that count causally). ``peak`` is measured in the same run by a large square
matmul in the step's dtype, before and after the steps (the better of the two), so the number
says how well the step uses this machine, not a datasheet. On a shared CPU both are noisy: the
load average is recorded.

The table crosses models (``--presets``), sequence lengths (``--seqs``) and attention choices
(``--attention``): ``padded`` (rows padded, torch SDPA), ``packed`` (THD: torch's varlen flash
kernel on CUDA in half precision, grouped SDPA elsewhere), ``flex`` (packed, compiled
FlexAttention with a document mask; CUDA only: its compilation falls in the warm-up step),
``te`` (transformer-engine's layers, packed; only where it is installed), ``packed-seg``
(``packed`` with Megatron's own rotary embedding, which megatron-core 0.19 applies one segment
at a time: the comparison for megarl/models/packed_rope.py; not in the defaults). A choice may
be repeated, to interleave the compared sides. Presets:
- ``1b``: a ~1.1B Qwen2-shaped model (24 layers, hidden 1536, 12 heads, 2 KV heads, FFN 4224,
  vocabulary 151936);
- ``72b-slice``: 2 layers with Qwen2.5-72B's per-rank shapes at TP=8, run at TP=1 (hidden 8192,
  8 query heads and 1 KV head of 128, FFN 3696, vocabulary 152064 / 8);
- ``cpu``: the log-prob bench's model (8 layers, hidden 512, vocabulary 32k).
CUDA defaults: both GPU presets, bf16, sequences 4096 and 16384, 2 rows, micro-batch 1, every
attention choice available. CPU defaults: the cpu preset in fp32, 8 rows x 512 tokens,
micro-batch 2, 2 threads, padded and packed. Writes bench/results/train_step.json
(device-tagged entries are merged).

Run: ``.venv/bin/python bench/train_step.py`` (``--presets``, ``--seqs``, ``--attention`` override;
``--results`` names another JSON to merge into, as ci/gpu/run.sh does).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from logprob import build_model, machine, make_batch  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "train_step.json"
PRESETS = {
    "1b": dict(layers=24, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=4224, vocab=151936),
    "72b-slice": dict(layers=2, hidden=8192, heads=8, kv_heads=1, head_dim=128, ffn=3696, vocab=152064 // 8),
    "cpu": dict(layers=8, hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1408, vocab=32000),
}
CUDA_DEFAULTS = dict(presets="1b,72b-slice", seqs="4096,16384", attention="padded,packed,flex,te", rows=2, micro=1,
                     dtype="bfloat16", matmul=8192)  # fmt: skip
CPU_DEFAULTS = dict(presets="cpu", seqs="512", attention="padded,packed", rows=8, micro=2, dtype="float32", matmul=2048)


def peak_flops(n: int, dtype: torch.dtype, device: str) -> float:
    """Achieved FLOP/s of an n x n matmul (best of a few)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def pg_loss(batch, outputs):
    mask = batch.response_mask.to(outputs.logprobs.dtype)
    loss_sum = -(outputs.logprobs * mask).sum()
    count = mask.sum()
    return loss_sum, count, {"actor/pg_loss": torch.stack([loss_sum.detach(), count])}


def parse() -> argparse.Namespace:
    defaults = CUDA_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in defaults.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile one more step of each row: torch operations "
                    "dispatched; CUDA: also the kernel table and the GPU's busy share")  # fmt: skip
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"JSON the entries are merged into (default: {RESULTS})")
    return ap.parse_args()


def timed_steps(worker, batch, steps: int, device: str) -> float:
    """Seconds of the fastest of ``steps`` updates, after a warm-up one."""
    worker.update(batch, pg_loss)
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.update(batch, pg_loss)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def profiled_step(worker, batch, label: str, device: str) -> dict:
    """One more update under torch's profiler: the torch operations the host dispatched
    (``host_ops``: on a GPU each is at least a kernel launch's worth of host time) and, on CUDA,
    the share of the step's wall time the GPU was busy (``gpu_busy``; low: the host is the
    bottleneck), with a table of the kernels that take the GPU's time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        start = time.perf_counter()
        worker.update(batch, pg_loss)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    found = {"host_ops": sum(e.count for e in events if e.key.startswith("aten::") and e.device_type == DeviceType.CPU)}
    if cuda:  # the kernels' own events (an op's CPU-side event repeats its kernels' time), as the table's total
        found["gpu_busy"] = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6 / wall
    busy = f", GPU busy {found['gpu_busy']:.0%}" if cuda else ""
    print(f"--- profile of {label}: step {wall:.3f} s (profiled), {found['host_ops']} torch operations{busy}")
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    return found


def measure(path: Path, shape: dict, attention: str, seq: int, args: argparse.Namespace, device: str) -> dict:
    """One row of the table: a fresh worker with ``attention``, its step time and FLOPs."""
    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig, OptimizerConfig

    cfg = ActorConfig(micro_batch_size=args.micro, recompute="none", pack_sequences=attention != "padded",
                      packed_attention="flex" if attention == "flex" else "auto", optimizer=OptimizerConfig(lr=1e-6))  # fmt: skip
    worker = PolicyWorker(path, cfg, args.dtype, seed=0, layer_spec="te" if attention == "te" else "local")
    if attention == "packed-seg":  # Megatron's rotary embedding back (megarl's: one row per packed token)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        worker.model.core.rotary_pos_emb.__class__ = RotaryEmbedding
    params = sum(p.numel() for p in worker.model.module.parameters())
    matmul_params = params - worker.model.core.embedding.word_embeddings.weight.numel()
    half = seq // 2
    batch = make_batch(args.rows, half, seq - half, shape["vocab"])
    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step_s = timed_steps(worker, batch, args.steps, device)
        extra = {"peak_gib": torch.cuda.max_memory_allocated() / 2**30} if device == "cuda" else {}
        if args.profile:
            extra.update(profiled_step(worker, batch, f"{shape['layers']} layers, {attention}, seq {seq}", device))
    finally:  # an OOM too: Megatron DDP's hooks keep an unclosed worker, and its memory, alive
        worker.close()
        del worker
        free_memory(device)
    tokens = args.rows * seq
    attention_flops = 12 * shape["layers"] * shape["heads"] * shape["head_dim"] * seq**2 * args.rows
    flops = 6 * matmul_params * tokens + attention_flops
    executed = flops - 6 * shape["vocab"] * shape["hidden"] * (tokens - args.rows * (seq - half))
    return {"attention": attention, "seq": seq, "params": params, "tokens": tokens, "step_seconds": step_s,
            "tokens_per_s": tokens / step_s, "model_tflops_per_s": flops / step_s / 1e12, "flops": flops,
            "executed_flops": executed, "attention_flops": attention_flops, **extra}  # fmt: skip


ROW_HEADER = (f"{'preset':<11}{'seq':>7}{'attention':>12}{'params':>15}{'step s':>9}{'tokens/s':>10}{'TFLOP/s':>9}"
              f"{'MFU':>7}{'exec':>7}{'peak GiB':>9}")


def finish_row(row: dict, peak: float) -> str:
    """Adds the MFU fields to a measured row (not to a failed one) and returns its table line."""
    if "error" in row:
        return f"{row['preset']:<11}{row['seq']:>7}{row['attention']:>12}  failed: {row['error']}"
    row["peak_tflops_per_s"], row["mfu"] = peak / 1e12, row["flops"] / row["step_seconds"] / peak
    row["mfu_executed"] = row["executed_flops"] / row["step_seconds"] / peak
    row["mfu_causal"] = (row["flops"] - row["attention_flops"] / 2) / row["step_seconds"] / peak
    return (f"{row['preset']:<11}{row['seq']:>7}{row['attention']:>12}{row['params']:>15,}{row['step_seconds']:>9.2f}"
            f"{row['tokens_per_s']:>10.0f}{row['model_tflops_per_s']:>9.3f}{row['mfu']:>7.1%}{row['mfu_executed']:>7.1%}"
            f"{row.get('peak_gib', float('nan')):>9.1f}")


def measure_or_fail(path: Path, shape: dict, attention: str, seq: int, args, device: str) -> dict:
    """``measure``, or the row with the out-of-memory error that stopped it (an OOM at 16k
    tokens is a result: it must not cost the rows already measured, nor the ones after it).
    Any other error ends the bench (a bug), after the rows before it were written."""
    try:
        return measure(path, shape, attention, seq, args, device)
    except torch.OutOfMemoryError as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
    free_memory(device)  # outside the handler: the exception's frames held the failed step's tensors
    return {"attention": attention, "seq": seq, "error": error}


def free_memory(device: str) -> None:
    gc.collect()  # the first pass runs the dropped worker's finalizers, the second frees it
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write_results(out: Path, device: str, info: dict, args, rows: list[dict]) -> None:
    """Merges this device's entry into ``out`` (after every row: a run stopped by a time limit
    keeps what it measured)."""
    existing = json.loads(out.read_text()) if out.exists() else {}
    info["load_avg_1m_after"] = os.getloadavg()[0]
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    # Another grid or batch shape is another experiment: kept beside the default one, not over it.
    changed = [f"{k} {getattr(args, k)}" for k, v in defaults.items() if getattr(args, k) != v]
    key = ", ".join([device, *changed])
    existing[key] = {"machine": info, "config": {**vars(args), "results": str(out)}, "results": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(existing, indent=2) + "\n")


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29534"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megarl.models.layer_specs import te_importable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    info = machine()
    runs = {"padded": True, "packed": True, "te": device == "cuda" and te_importable(), "flex": device == "cuda",
            "packed-seg": True}  # fmt: skip
    unknown = sorted(set(args.attention.split(",")) - set(runs))
    if unknown:
        raise SystemExit(f"--attention {','.join(unknown)}: choose from {', '.join(runs)}")
    choices = [a for a in args.attention.split(",") if runs[a]]
    peak = peak_flops(args.matmul, dtype, device)
    print(f"{device}, {args.dtype}, {args.rows} rows, micro-batch {args.micro}; peak (matmul {args.matmul}) "
          f"{peak / 1e12:.2f} TFLOP/s (re-measured at the end)\n{ROW_HEADER}", flush=True)
    rows = []
    seqs = [int(s) for s in args.seqs.split(",")]
    for preset in args.presets.split(","):
        shape = PRESETS[preset]
        with tempfile.TemporaryDirectory() as tmp:
            path = build_model(Path(tmp) / "m", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"],
                               shape["vocab"], ffn=shape["ffn"], head_dim=shape["head_dim"],
                               max_positions=max(seqs))  # fmt: skip
            for seq in seqs:
                for attention in choices:
                    rows.append({"preset": preset, **measure_or_fail(path, shape, attention, seq, args, device)})
                    print(finish_row(rows[-1], peak), flush=True)
                    write_results(args.results, device, info, args, rows)
    peak = max(peak, peak_flops(args.matmul, dtype, device))
    print(f"peak (better of before and after) {peak / 1e12:.2f} TFLOP/s\n{ROW_HEADER}")
    for row in rows:
        print(finish_row(row, peak))
    write_results(args.results, device, info, args, rows)
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
