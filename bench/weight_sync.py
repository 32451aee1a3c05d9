"""Benchmark: weight sync of a ~0.5B Qwen2-shaped model, Megatron TP=2 -> torch engine (in-process).

Two gloo processes (one thread each) build a Megatron model at TP=2 (bf16, no optimizer) from a
random-init HF directory shaped like Qwen2-0.5B (24 layers, hidden 896, 14 heads, 2 KV heads,
FFN 4864, vocab 151936, tied embeddings); rank 0 also holds the torch engine. Measured:

- export only: the shared stream (TP all-gather + HF conversion + bucketing), no engine;
- full push: export + ``engine.load_weights`` (InProcessTransport), metrics as reported;
- all-gather: one ``all_gather_into_tensor`` of the same number of bytes between the same two
  processes (each sends half): the wire a TP=2 export can reach here;
- memcpy: one ``copy_`` of the same number of bytes on rank 0, same thread count, same run.

The three sides run interleaved, ``--reps`` times; each ratio is the median of the per-rep
ratios.

Prints a table and writes bench/results/weight_sync.json (machine, load, date).

    .venv/bin/python bench/weight_sync.py [--bucket-mb 512] [--reps 3] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from rollout import machine  # noqa: E402  (bench/rollout.py: machine description)

QWEN2_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, ffn_hidden_size=4864,
                 vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
SMALL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=256,
             vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512)


def build_hf_dir(out: Path, shape: dict) -> int:
    """Write the random-init HF model (bf16); returns its parameter count."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import tiny_hf_config

    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen2", **shape)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def memcpy_seconds(nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def gather_seconds(nbytes: int) -> float:
    """One all-gather of ``nbytes`` in total between the two ranks (each sends half)."""
    import torch.distributed as dist

    local = torch.ones(nbytes // 2, dtype=torch.uint8)
    out = torch.empty(2 * local.numel(), dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    dist.all_gather_into_tensor(out, local)
    return time.perf_counter() - start


def timed_push(sync, version: int) -> dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    return sync.push(version)


def rank_main(rank: int, port: int, model_dir: str, bucket_mb: float, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megarl.actors.megatron_runtime.model import MegatronModel
    from megarl.config.sections import ActorConfig, ParallelConfig
    from megarl.parallel.groups import destroy_parallel
    from megarl.rollout.torch_engine import TorchEngine
    from megarl.rollout.transports import InProcessTransport
    from megarl.rollout.weight_stream import WeightStream

    model = MegatronModel.build(model_dir, ActorConfig(parallel=ParallelConfig(tp=2)), torch.bfloat16, seed=1)
    engine = TorchEngine(model_dir, dtype="bfloat16") if rank == 0 else None
    stream = WeightStream(partial(model.bridge.export_hf_tensors, model.core), bucket_mb=bucket_mb)
    export_only, full = InProcessTransport(stream), InProcessTransport(stream, [engine] if engine is not None else [])
    export_only.connect(None)
    full.connect(None)
    runs: dict[str, list] = {"export_only": [], "push": [], "all_gather_seconds": []}
    for rep in range(reps):
        runs["export_only"].append(timed_push(export_only, 0))
        runs["push"].append(timed_push(full, rep + 1))
        runs["all_gather_seconds"].append(gather_seconds(int(runs["push"][-1]["weight_sync/bytes"])))
    dist.barrier()
    if rank == 0:
        nbytes = int(runs["push"][0]["weight_sync/bytes"])
        copy_s = memcpy_seconds(nbytes, reps)
        Path(out).write_text(json.dumps({"runs": runs, "memcpy_seconds": copy_s, "bytes": nbytes,
                                         "peak_stream_bytes": stream.peak_bytes}))
    dist.barrier()
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny model, to check the script")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = machine()
    shape = SMALL if args.small else QWEN2_05B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = build_hf_dir(model_dir, shape)
        raw = Path(tmp) / "raw.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(port, str(model_dir), args.bucket_mb, args.reps, str(raw)), nprocs=2, join=True)
        data = json.loads(raw.read_text())
    runs = data["runs"]
    seconds = {k: [m["weight_sync/seconds"] for m in runs[k]] for k in ("export_only", "push")}
    seconds["all_gather"] = runs["all_gather_seconds"]
    copy_gbps = data["bytes"] / data["memcpy_seconds"] / 1e9
    ratios = {f"{k}_over_all_gather_throughput": statistics.median(g / s for g, s in zip(seconds["all_gather"], seconds[k]))
              for k in ("export_only", "push")}  # fmt: skip
    push_gbps = data["bytes"] / statistics.median(seconds["push"]) / 1e9
    print(f"model: {params / 1e6:.0f}M params, {data['bytes'] / 2**30:.2f} GiB (bf16), bucket {args.bucket_mb} MiB")
    print(f"{'what':<14}{'median s':>10}{'GB/s':>10}")
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"{name:<14}{med:>10.3f}{data['bytes'] / med / 1e9:>10.3f}")
    print(f"{'memcpy':<14}{data['memcpy_seconds']:>10.3f}{copy_gbps:>10.3f}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}")
    print(f"push / memcpy throughput: {push_gbps / copy_gbps:.3f}")
    best = {k: min(v, key=lambda m: m["weight_sync/seconds"]) for k, v in runs.items() if k != "all_gather_seconds"}
    result = {
        "benchmark": "weight sync: Megatron TP=2 (2 gloo processes, 1 thread each) -> torch engine in-process",
        "model": ("qwen2 " + json.dumps(shape)), "params": params, "dtype": "bfloat16",
        "bucket_mb": args.bucket_mb, "bytes": data["bytes"], "runs": data["runs"],
        "best": best, "memcpy_seconds": data["memcpy_seconds"], "memcpy_gbps": copy_gbps,
        "push_over_memcpy_throughput": push_gbps / copy_gbps, **ratios,
        "peak_stream_bytes": data["peak_stream_bytes"],
        "machine_before": before, "load_avg_after": os.getloadavg(),
    }
    if not args.small:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
