"""Benchmark: torch rollout engine vs plain ``transformers`` generate, sampling tokens/s on CPU.

Same random-init Qwen2-shaped model (8 layers, hidden 512, 8 heads, 2 KV heads, FFN 1536,
vocab 32000, fp32), same 64 prompts of 128 tokens, 128 new tokens each (no EOS: the model has
none, so both always produce 128), temperature 1, no top-p/top-k, 2 threads. Prints a table and
writes bench/results/rollout.json.

    OMP_NUM_THREADS=2 .venv/bin/python bench/rollout.py [--reps 2] [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import describe  # noqa: E402  (bench/machine.py)


def machine() -> dict:
    return describe()  # bench/machine.py

def build_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import tiny_hf_config

    cfg = tiny_hf_config(
        "qwen2", vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
        ffn_hidden_size=1536, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def time_engine(engine, prompts: list[list[int]], new_tokens: int, seed: int) -> tuple[float, float, int]:
    from megarl.engines.base import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, seed=seed)
    start, cpu = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - cpu, sum(len(r.response_ids) for r in results)


def time_hf(model, prompts: list[list[int]], new_tokens: int, seed: int) -> tuple[float, float, int]:
    ids = torch.tensor(prompts)  # all prompts have the same length: no padding
    torch.manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
            top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
        )
    return time.perf_counter() - start, time.process_time() - cpu, (out.shape[1] - ids.shape[1]) * ids.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from megarl.engines.torch_engine import TorchEngine

    before = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        engine = TorchEngine(model_dir, dtype="float32", max_running_requests=args.prompts)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 32000, (args.prompts, args.prompt_len), generator=gen).tolist()
    time_engine(engine, prompts[:4], 4, 0)  # warm-up
    time_hf(hf, prompts[:4], 4, 0)
    # wall-clock tok/s, and tok/s per CPU-second of this process (threads summed): the second
    # is less sensitive to other jobs on a shared machine; both are recorded
    runs: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in ("torch_engine", "hf_generate")}
    for rep in range(args.reps):  # alternate so both see the same machine conditions
        for name, fn, model in (("torch_engine", time_engine, engine), ("hf_generate", time_hf, hf)):
            wall, cpu, toks = fn(model, prompts, args.new_tokens, rep)
            runs[name]["wall"].append(toks / wall)
            runs[name]["cpu"].append(toks / cpu)
            print(f"rep {rep} {name}: {toks / wall:.1f} tok/s wall, {toks / cpu:.1f} tok/cpu-s, load {os.getloadavg()[0]:.2f}", flush=True)
    best = {k: {m: max(v[m]) for m in v} for k, v in runs.items()}
    median = {k: {m: statistics.median(v[m]) for m in v} for k, v in runs.items()}
    ratio = {m: best["torch_engine"][m] / best["hf_generate"][m] for m in ("wall", "cpu")}
    print(f"{'implementation':<16}{'best tok/s':>12}{'median tok/s':>14}{'best tok/cpu-s':>16}")
    for name in runs:
        print(f"{name:<16}{best[name]['wall']:>12.1f}{median[name]['wall']:>14.1f}{best[name]['cpu']:>16.1f}")
    print(f"ratio torch_engine / hf_generate (best): wall {ratio['wall']:.3f}x, cpu-time {ratio['cpu']:.3f}x")
    result = {
        "benchmark": "rollout: torch engine vs transformers generate (sampling, T=1)",
        "model": "qwen2, 8 layers, hidden 512, 8 heads, 2 kv heads, ffn 1536, vocab 32000, fp32, random init",
        "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "tokens_per_s": runs, "best": best, "median": median, "ratio_engine_over_hf": ratio,
        "machine_before": before, "load_avg_after": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
