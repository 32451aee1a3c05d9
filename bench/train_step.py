"""Training-step throughput and MFU of PolicyWorker.update (one optimizer step, one process).

One step = forward + backward over every micro-batch of the batch, gradient clipping and the
Adam step, through Megatron's schedule with a token-mean policy-gradient loss. MFU:

    flops = 6 x params x tokens + 12 x layers x hidden x seq^2 x batch
    MFU   = flops / step_seconds / peak

``params`` excludes the input embedding table (a lookup, no matmul; the LM head counts). The
worker runs the LM head at response positions only (half the tokens here), so the formula
counts more than is executed: ``mfu_executed`` counts the LM head on response tokens only. And
``peak`` is measured in the same run by a large square matmul in the step's dtype, before and
after the steps (the better of the two), so the number says how well the step uses this
machine, not a datasheet. On a shared CPU both are noisy: the load average is recorded.

Defaults: on CUDA a ~1.1B Qwen2-shaped model (24 layers, hidden 1536, 12 heads, 2 KV heads,
ffn 4224, vocab 151936) in bf16 at seq 4096, 2 rows, micro-batch 1; on CPU the log-prob
bench's model (8 layers, hidden 512, vocab 32k) in fp32, 8 rows x 512 tokens, micro-batch 2,
2 threads. Writes bench/results/train_step.json (device-tagged entries are merged).

Run: ``.venv/bin/python bench/train_step.py`` (add --layers/--hidden/... to override).
"""

from __future__ import annotations

import argparse
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
CUDA_DEFAULTS = dict(layers=24, hidden=1536, heads=12, kv_heads=2, vocab=151936, rows=2, seq=4096, micro=1, dtype="bfloat16", matmul=8192)
CPU_DEFAULTS = dict(layers=8, hidden=512, heads=8, kv_heads=2, vocab=32000, rows=8, seq=512, micro=2, dtype="float32", matmul=2048)


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
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29534"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megarl.actors.policy import PolicyWorker
    from megarl.config.sections import ActorConfig, OptimizerConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    info = machine()
    peak = peak_flops(args.matmul, dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", args.layers, args.hidden, args.heads, args.kv_heads, args.vocab)
        cfg = ActorConfig(micro_batch_size=args.micro, recompute="none", optimizer=OptimizerConfig(lr=1e-6))
        worker = PolicyWorker(path, cfg, args.dtype, seed=0)
    params = sum(p.numel() for p in worker.model.module.parameters())
    embedding = worker.model.core.embedding.word_embeddings.weight.numel()
    matmul_params = params - embedding
    half = args.seq // 2
    batch = make_batch(args.rows, half, args.seq - half, args.vocab)
    worker.update(batch, pg_loss)  # warm-up
    times = []
    for _ in range(args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.update(batch, pg_loss)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = min(times)
    peak = max(peak, peak_flops(args.matmul, dtype, device))
    tokens = args.rows * args.seq
    flops = 6 * matmul_params * tokens + 12 * args.layers * args.hidden * args.seq**2 * args.rows
    lm_head = args.vocab * args.hidden
    executed = flops - 6 * lm_head * (tokens - args.rows * (args.seq - half))
    row = {
        "device": device, "dtype": args.dtype, "params": params, "matmul_params": matmul_params, "tokens": tokens, "step_seconds": step_s,
        "tokens_per_s": tokens / step_s, "model_tflops_per_s": flops / step_s / 1e12,
        "peak_tflops_per_s": peak / 1e12, "mfu": flops / step_s / peak,
        "mfu_executed": executed / step_s / peak,
    }
    info["load_avg_1m_after"] = os.getloadavg()[0]
    print(f"{'device':<8}{'params':>12}{'tokens':>8}{'step s':>9}{'tokens/s':>10}{'TFLOP/s':>9}{'peak':>8}{'MFU':>7}")
    print(f"{device:<8}{params:>12,}{tokens:>8}{step_s:>9.2f}{row['tokens_per_s']:>10.0f}"
          f"{row['model_tflops_per_s']:>9.3f}{row['peak_tflops_per_s']:>8.3f}{row['mfu']:>7.1%}  (executed: {row['mfu_executed']:.1%})")
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    existing[device] = {"machine": info, "config": vars(args), "result": row}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
