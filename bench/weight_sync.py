"""Benchmark: weight sync of a ~0.5B Qwen2-shaped model, Megatron TP=2 or PP=2 -> torch engine (in-process).

Two gloo processes (one thread each) build a Megatron model at TP=2 and then at PP=2 (bf16, no
optimizer) from a random-init HF directory shaped like Qwen2-0.5B (24 layers, hidden 896, 14
heads, 2 KV heads, FFN 4864, vocab 151936, tied embeddings); rank 0 (the replica's leader) also
holds the torch engine. Measured, per layout:

- export only: the shared stream (TP all-gather, stage collection to the leader, HF
  conversion, bucketing), no engine;
- push: export + ``engine.load_weights`` (InProcessTransport), export and load one after the
  other (``overlap=False``) and double-buffered (``overlap=True``);
- at TP=2, also the push with one TP all-gather per tensor (``rollout.weight_sync.gather_mb``
  = 0) and with a bucket's worth of tensors per all-gather (``gather_mb`` = ``bucket_mb``),
  against the default groups (1 MiB);
- at PP=2, also the push through the stage collection that sends every stage to every rank
  (``collect="all"``, what the in-process push did before it sent to the leader only);
- all-gather: one ``all_gather_single`` (``all_gather_into_tensor``) of the same number of bytes between the same two
  processes (each sends half): the wire a push can reach here; and the same bytes in 16 MiB
  all-gathers, each into fresh memory as an export's are (gloo moves one large message at a
  fraction of the rate of medium ones here);
- memcpy: one ``copy_`` of the same number of bytes on rank 0, same thread count, same run.

The sides run interleaved, ``--reps`` times; each ratio is the median of the per-rep ratios.
The stream's peak (the most exported bytes held at once) is reported for both overlap modes,
with rank 0's peak resident memory.

Prints a table and writes bench/results/weight_sync.json (machine, load, date).

    .venv/bin/python bench/weight_sync.py [--bucket-mb 512] [--reps 5] [--small]

``--small``: a 2-layer model of 1 MB, where per-collective latency, not bytes, sets the time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}
BASELINES = {"all_gather_seconds": None, "all_gather_16mib_seconds": 16 << 20}  # one all-gather, or one per 16 MiB


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


def gather_seconds(nbytes: int, chunk: int | None = None) -> float:
    """All-gathers of ``nbytes`` in total between the two ranks (each sends half): one, or one
    per ``chunk`` bytes."""
    import torch.distributed as dist

    from megarl.parallel.sharding import all_gather_flat

    chunk = min(chunk or nbytes, nbytes)
    local = torch.ones(chunk // 2, dtype=torch.uint8)
    out = torch.empty(2 * local.numel(), dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(max(1, round(nbytes / chunk))):
        all_gather_flat(out, local, None)
        if chunk < nbytes:  # each into fresh memory, as an export's gathers are (not the one above)
            out = torch.empty_like(out)
    return time.perf_counter() - start


def timed_push(sync, version: int) -> dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    return sync.push(version)


def rank_main(rank: int, port: int, model_dir: str, layout: str, bucket_mb: float, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      CUDA_VISIBLE_DEVICES="")  # a gloo bench of CPU tensors, also on a GPU box  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megarl.config.rollout_sections import WeightSyncConfig
    from megarl.config.train_sections import ActorConfig, ParallelConfig
    from megarl.engines.torch_engine import TorchEngine
    from megarl.megatron_runtime.model import MegatronModel
    from megarl.parallel.groups import destroy_parallel
    from megarl.weight_sync.stream import MIB, WeightStream
    from megarl.weight_sync.transports import InProcessTransport

    model = MegatronModel.build(model_dir, ActorConfig(parallel=ParallelConfig(**LAYOUTS[layout])), torch.bfloat16, seed=1)
    engine = [TorchEngine(model_dir, dtype="bfloat16")] if rank == 0 else []

    default = int(WeightSyncConfig().gather_mb * MIB)  # rollout.weight_sync.gather_mb's default

    def transport(engines: list, overlap: bool, collect: str = "leader", gather_bytes: int | None = None) -> InProcessTransport:
        gather_bytes = default if gather_bytes is None else gather_bytes
        export = partial(model.bridge.export_hf_tensors, model.core, gather_bytes=gather_bytes, collect=collect)
        sync = InProcessTransport(WeightStream(export, bucket_mb=bucket_mb, overlap=overlap), engines)
        sync.connect(None)
        return sync

    sides = {"export_only": transport([], True), "push_sequential": transport(engine, False),
             "push_overlap": transport(engine, True)}
    if layout == "pp2":
        sides["push_collect_all"] = transport(engine, True, collect="all")
    else:
        sides["push_gather_each"] = transport(engine, True, gather_bytes=0)
        sides["push_gather_bucket"] = transport(engine, True, gather_bytes=int(bucket_mb * MIB))
    runs: dict[str, list] = {k: [] for k in [*sides, *BASELINES]}
    version = 0
    for _ in range(reps):
        for name, sync in sides.items():
            version += 1
            runs[name].append(timed_push(sync, version))
        # The leader's bytes (at PP=2 the other stage yields only its own tensors).
        nbytes = [int(runs["push_overlap"][-1]["weight_sync/bytes"])]
        dist.broadcast_object_list(nbytes, src=0)
        for baseline, chunk in BASELINES.items():
            runs[baseline].append(gather_seconds(nbytes[0], chunk))
    dist.barrier()
    if rank == 0:
        nbytes = int(runs["push_overlap"][0]["weight_sync/bytes"])
        Path(out).write_text(json.dumps({
            "runs": runs, "memcpy_seconds": memcpy_seconds(nbytes, reps), "bytes": nbytes,
            "peak_stream_bytes": {k: sides[k].stream.peak_bytes for k in ("push_sequential", "push_overlap")},
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in engine[0].model.parameters()),
            "rank0_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }))
    dist.barrier()
    destroy_parallel()


def run_layout(layout: str, model_dir: Path, bucket_mb: float, reps: int, tmp: Path) -> dict:
    raw = tmp / f"raw_{layout}.json"
    # The ranks (spawned: a fresh glibc) map and unmap every large allocation. glibc's default
    # raises its mmap threshold as large blocks are freed, and then keeps the freed GiBs of five
    # interleaved sides' pushes in its heap: rank 0 was OOM-killed at 16 GiB of 24 GiB here.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, str(model_dir), layout, bucket_mb, reps, str(raw)), nprocs=2, join=True)
    data = json.loads(raw.read_text())
    runs = data["runs"]
    seconds = {k: [m["weight_sync/seconds"] for m in v] for k, v in runs.items() if k not in BASELINES}
    gather, chunked = runs["all_gather_seconds"], runs["all_gather_16mib_seconds"]
    copy_gbps = data["bytes"] / data["memcpy_seconds"] / 1e9
    ratios = {f"{k}_over_all_gather_throughput": statistics.median(g / s for g, s in zip(gather, v))
              for k, v in seconds.items()}  # fmt: skip
    ratios |= {f"{k}_over_all_gather_16mib_throughput": statistics.median(g / s for g, s in zip(chunked, v))
               for k, v in seconds.items()}  # fmt: skip
    ratios["overlap_speedup"] = statistics.median(a / b for a, b in zip(seconds["push_sequential"], seconds["push_overlap"]))
    if "push_collect_all" in seconds:
        ratios["leader_over_collect_all_speedup"] = statistics.median(
            a / b for a, b in zip(seconds["push_collect_all"], seconds["push_overlap"]))
    for grouping in ("each", "bucket"):  # the default gather group against one tensor, and a bucket
        if f"push_gather_{grouping}" in seconds:
            ratios[f"default_gather_over_{grouping}_speedup"] = statistics.median(
                a / b for a, b in zip(seconds[f"push_gather_{grouping}"], seconds["push_overlap"]))
    print(f"\n{layout}: {data['bytes'] / 2**30:.2f} GiB (bf16) per push, bucket {bucket_mb} MiB")
    print(f"{'what':<18}{'median s':>10}{'GB/s':>10}")
    for name, values in [*seconds.items(), ("all_gather", gather), ("all_gather_16mib", chunked)]:
        med = statistics.median(values)
        print(f"{name:<18}{med:>10.3f}{data['bytes'] / med / 1e9:>10.3f}")
    print(f"{'memcpy':<18}{data['memcpy_seconds']:>10.3f}{copy_gbps:>10.3f}")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}")
    push_gbps = data["bytes"] / statistics.median(seconds["push_overlap"]) / 1e9
    peaks = data["peak_stream_bytes"]
    print(f"stream peak (MiB): sequential {peaks['push_sequential'] / 2**20:.0f}, overlap {peaks['push_overlap'] / 2**20:.0f}"
          f" (bound 2 x bucket + largest tensor = {(2 * bucket_mb * 2**20 + data['largest_tensor_bytes']) / 2**20:.0f});"
          f" rank 0 peak RSS {data['rank0_max_rss_bytes'] / 2**30:.2f} GiB")
    return {"bytes": data["bytes"], "runs": runs, "median_seconds": {k: statistics.median(v) for k, v in seconds.items()},
            "memcpy_seconds": data["memcpy_seconds"], "memcpy_gbps": copy_gbps,
            "push_over_memcpy_throughput": push_gbps / copy_gbps, **ratios, "peak_stream_bytes": peaks,
            "largest_tensor_bytes": data["largest_tensor_bytes"], "rank0_max_rss_bytes": data["rank0_max_rss_bytes"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layouts", default="tp2,pp2", help="comma-separated: tp2, pp2")
    parser.add_argument("--small", action="store_true",
                        help="a tiny model (latency-bound: many small tensors), results in weight_sync_small.json")
    parser.add_argument("--out", default=None, help="default: bench/results/weight_sync[_small].json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = machine()
    shape = SMALL if args.small else QWEN2_05B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = build_hf_dir(model_dir, shape)
        print(f"model: {params / 1e6:.0f}M params")
        layouts = {name: run_layout(name, model_dir, args.bucket_mb, args.reps, Path(tmp)) for name in args.layouts.split(",")}
    from megarl.config.rollout_sections import WeightSyncConfig

    result = {
        "benchmark": "weight sync: Megatron TP=2 / PP=2 (2 gloo processes, 1 thread each) -> torch engine in-process",
        "model": ("qwen2 " + json.dumps(shape)), "params": params, "dtype": "bfloat16", "bucket_mb": args.bucket_mb,
        "gather_mb": WeightSyncConfig().gather_mb, "env": {"MALLOC_MMAP_THRESHOLD_": os.environ["MALLOC_MMAP_THRESHOLD_"]},
        "layouts": layouts, "machine_before": before, "load_avg_after": os.getloadavg(),
    }
    print(json.dumps({k: result[k] for k in ("gather_mb", "env")}))
    out = args.out or str(Path(__file__).parent / "results" / f"weight_sync{'_small' if args.small else ''}.json")
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
