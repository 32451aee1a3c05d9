"""Log-prob throughput: PolicyWorker (Megatron, TP=1, one process) vs a plain HF forward.

Same random-init Qwen2-shaped model (8 layers, hidden 512, 8 heads, 2 KV heads, vocabulary
32k), same inputs (8 rows x 512 tokens: 256 prompt + 256 response), same micro-batch size,
float32, 2 threads. The HF side is ``Qwen2ForCausalLM`` with ``attn_implementation="sdpa"``:
logits -> slice the response columns -> ``log_softmax(logits / T)`` -> gather. The Megatron
side is ``PolicyWorker.compute_logprobs`` (vocab-parallel log-softmax, Megatron's schedule).
Both results are compared (max abs difference) so the speed is of the same computation. The
two run interleaved (a, b, a, b, ...) ``--repeats`` times after one warm-up each; the result is
the median of the per-pair time ratios (the machine is shared; its load before and after is
recorded). Differences: HF computes logits at every position, the worker only at the real
response tokens, in chunks (``actor.logprob_chunk_tokens``); Megatron's unfused RoPE (cos/sin
per layer, rotate-half by cat) costs extra on CPU.

Run: ``OMP_NUM_THREADS=2 .venv/bin/python bench/logprob.py``; writes bench/results/logprob.json.
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

RESULTS = Path(__file__).parent / "results" / "logprob.json"


def machine() -> dict:
    return describe()  # bench/machine.py

def build_model(out: Path, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, *,
                ffn: int | None = None, head_dim: int | None = None, max_positions: int = 2048) -> Path:  # fmt: skip
    """A random-init Qwen2-shaped HF model in ``out`` (FFN ``hidden x 11/4`` and head size
    ``hidden / heads`` unless given)."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import tiny_hf_config

    cfg = tiny_hf_config(
        "qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=ffn or hidden * 11 // 4, max_position_embeddings=max_positions,
    )
    if head_dim is not None:
        cfg.head_dim = head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def make_batch(rows: int, prompt: int, response: int, vocab: int):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    return Batch(
        prompt_ids=torch.randint(0, vocab, (rows, prompt), generator=g),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        response_ids=torch.randint(0, vocab, (rows, response), generator=g),
        response_lengths=torch.full((rows,), response),
        response_mask=torch.ones(rows, response),
        group_id=torch.arange(rows),
    )


def hf_logprobs(model, batch, temperature: float, micro: int) -> torch.Tensor:
    tokens, _, _ = batch.sequences()
    p = batch.prompt_len
    out = []
    with torch.no_grad():
        for chunk, resp in zip(tokens.split(micro), batch.response_ids.split(micro)):
            logits = model(chunk).logits[:, p - 1 : -1].float() / temperature  # [b, R, V]
            out.append(torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0])
    return torch.cat(out)


def interleaved(fns: list, repeats: int) -> tuple[list[list[float]], list]:
    """Seconds of every run of each function, runs interleaved (a, b, a, b, ...) so that a
    change in machine load hits both alike; one warm-up run each first. Returns the times and
    each function's last result."""
    results: list = [fn() for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - start)
    return times, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    # A CPU bench (the HF side runs on the CPU): the worker too, also on a GPU box. Set before
    # anything asks torch for a GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

    from transformers import AutoModelForCausalLM

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig
    from megarl.data.batch import TokenRows

    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", args.layers, args.hidden, 8, 2, args.vocab)
        batch = make_batch(args.rows, args.prompt, args.response, args.vocab)
        tokens = args.rows * (args.prompt + args.response)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        worker = PolicyWorker(path, ActorConfig(micro_batch_size=args.micro), "float32", seed=0)
        (hf_times, mg_times), (hf_lp, mg_rows) = interleaved(
            [lambda: hf_logprobs(hf, batch, 0.8, args.micro), lambda: worker.compute_logprobs(batch, 0.8)], args.repeats
        )
    mg_lp = TokenRows.assemble([mg_rows], len(batch), batch.response_len)["logprobs"]
    diff = float((mg_lp - hf_lp).abs().max())
    hf_s, mg_s = statistics.median(hf_times), statistics.median(mg_times)
    rows = [
        {"impl": "hf_sdpa", "seconds": hf_times, "median_tokens_per_s": tokens / hf_s},
        {"impl": "megarl_policy", "seconds": mg_times, "median_tokens_per_s": tokens / mg_s},
    ]
    print(f"{'impl':<16}{'median s':>10}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['impl']:<16}{statistics.median(r['seconds']):>10.3f}{r['median_tokens_per_s']:>12.0f}")
    speedup = statistics.median(h / m for h, m in zip(hf_times, mg_times))
    print(f"speed-up megarl / HF (median of {args.repeats} interleaved pairs): {speedup:.2f}x   "
          f"max |logprob diff|: {diff:.2e}   load {info['load_avg_1m']:.1f} -> {os.getloadavg()[0]:.1f}")
    info["load_avg_1m_after"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": info, "config": vars(args), "tokens": tokens, "results": rows,
        "speedup_vs_hf": speedup, "max_abs_logprob_diff": diff,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
