"""Training-step throughput and MFU of PolicyWorker.update (one optimizer step, one process).

One step = forward + backward over every micro-batch of the batch, gradient clipping and the
Adam step, through Megatron's schedule with a token-mean policy-gradient loss. MFU:

    flops = 6 x params x tokens + 12 x layers x q_dim x seq^2 x rows
    MFU   = flops / step_seconds / peak

``params`` excludes the input embedding table (a lookup, no matmul; the LM head counts);
``q_dim`` is query heads x head size. The worker runs the LM head at response positions only
(half the tokens here), so the formula counts more than is executed: ``mfu_executed`` counts
the LM head on response tokens only. ``peak`` is measured in the same run by a large square
matmul in the step's dtype, before and after the steps (the better of the two), so the number
says how well the step uses this machine, not a datasheet. On a shared CPU both are noisy: the
load average is recorded.

The table crosses models (``--presets``), sequence lengths (``--seqs``) and attention choices
(``--attention``): ``padded`` (rows padded, torch SDPA), ``packed`` (THD: torch's varlen flash
kernel on CUDA in half precision, grouped SDPA elsewhere), ``flex`` (packed, compiled
FlexAttention with a document mask; CUDA only: its compilation falls in the warm-up step),
``te`` (transformer-engine's layers, packed; only where it is installed). Presets:
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


def measure(path: Path, shape: dict, attention: str, seq: int, args: argparse.Namespace, device: str) -> dict:
    """One row of the table: a fresh worker with ``attention``, its step time and FLOPs."""
    from megarl.actors.policy import PolicyWorker
    from megarl.config.sections import ActorConfig, OptimizerConfig

    cfg = ActorConfig(micro_batch_size=args.micro, recompute="none", pack_sequences=attention != "padded",
                      packed_attention="flex" if attention == "flex" else "auto", optimizer=OptimizerConfig(lr=1e-6))  # fmt: skip
    worker = PolicyWorker(path, cfg, args.dtype, seed=0, layer_spec="te" if attention == "te" else "local")
    params = sum(p.numel() for p in worker.model.module.parameters())
    matmul_params = params - worker.model.core.embedding.word_embeddings.weight.numel()
    half = seq // 2
    step_s = timed_steps(worker, make_batch(args.rows, half, seq - half, shape["vocab"]), args.steps, device)
    # The worker sits in reference cycles (DDP's grad hooks, the config's bound no_sync): free it
    # now, not whenever the collector runs, or the next preset's worker may not fit on the GPU.
    del worker
    gc.collect()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = args.rows * seq
    flops = 6 * matmul_params * tokens + 12 * shape["layers"] * shape["heads"] * shape["head_dim"] * seq**2 * args.rows
    executed = flops - 6 * shape["vocab"] * shape["hidden"] * (tokens - args.rows * (seq - half))
    return {"attention": attention, "seq": seq, "params": params, "tokens": tokens, "step_seconds": step_s,
            "tokens_per_s": tokens / step_s, "model_tflops_per_s": flops / step_s / 1e12, "flops": flops,
            "executed_flops": executed}  # fmt: skip


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29534"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megarl.models.layer_specs import te_importable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    info = machine()
    runs = {"padded": True, "packed": True, "te": device == "cuda" and te_importable(), "flex": device == "cuda"}
    unknown = sorted(set(args.attention.split(",")) - set(runs))
    if unknown:
        raise SystemExit(f"--attention {','.join(unknown)}: choose from {', '.join(runs)}")
    choices = [a for a in args.attention.split(",") if runs[a]]
    peak = peak_flops(args.matmul, dtype, device)
    rows = []
    seqs = [int(s) for s in args.seqs.split(",")]
    for preset in args.presets.split(","):
        shape = PRESETS[preset]
        with tempfile.TemporaryDirectory() as tmp:
            path = build_model(Path(tmp) / "m", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"],
                               shape["vocab"], ffn=shape["ffn"], head_dim=shape["head_dim"],
                               max_positions=max(seqs))  # fmt: skip
            rows += [{"preset": preset, **measure(path, shape, a, seq, args, device)} for seq in seqs for a in choices]
    peak = max(peak, peak_flops(args.matmul, dtype, device))
    print(f"{device}, {args.dtype}, {args.rows} rows, micro-batch {args.micro}; peak (matmul {args.matmul}) "
          f"{peak / 1e12:.2f} TFLOP/s")
    print(f"{'preset':<11}{'seq':>7}{'attention':>10}{'params':>15}{'step s':>9}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'exec':>7}")
    for r in rows:
        r["peak_tflops_per_s"], r["mfu"], r["mfu_executed"] = peak / 1e12, r["flops"] / r["step_seconds"] / peak, r["executed_flops"] / r["step_seconds"] / peak
        print(f"{r['preset']:<11}{r['seq']:>7}{r['attention']:>10}{r['params']:>15,}{r['step_seconds']:>9.2f}"
              f"{r['tokens_per_s']:>10.0f}{r['model_tflops_per_s']:>9.3f}{r['mfu']:>7.1%}{r['mfu_executed']:>7.1%}")
    info["load_avg_1m_after"] = os.getloadavg()[0]
    out = args.results
    existing = json.loads(out.read_text()) if out.exists() else {}
    existing[device] = {"machine": info, "config": {**vars(args), "results": str(out)}, "results": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
