"""Packed vs padded micro-batches on a ragged batch: log-prob and train-step throughput.

A batch of ``--rows`` responses whose lengths are drawn log-uniformly between ``--shortest`` and
``--longest`` tokens (long-tailed: most short, a few long, as RL responses are), after prompts
of ``--prompt`` tokens, on the log-prob bench's Qwen2-shaped model (8 layers, hidden 512, 8 heads,
2 KV heads) with a vocabulary of 8192. The same PolicyWorker (one process, TP=1, fp32) runs it with
``actor.pack_sequences`` true and false, both under the same token budget
(``actor.max_tokens_per_gpu``): packed, micro-batches hold up to the budget of real tokens;
padded, rows x the longest row. The HF transformers forward (``attn_implementation="sdpa"``)
runs each row alone, on its real tokens only (no padding: its best case), for the log-probs.

Measured: seconds of ``compute_logprobs`` (packed, padded, HF, interleaved) and of one
``update`` (packed, padded, interleaved), ``--repeats`` times after a warm-up each; reported
as the median of the per-round ratios. The padded side computes ``padded tokens`` (the sum
over its micro-batches of rows x width); the padding ratio is that over the real tokens.
The issue's target for packing: packed speed-up >= 0.7 x padding ratio. Results are compared
(max |log-prob difference|) so the speeds are of the same computation.

Run: ``OMP_NUM_THREADS=2 .venv/bin/python bench/packing.py``; writes bench/results/packing.json
(``--out`` elsewhere). The demo's short, nearly uniform rows, where packing has little padding
to save: ``--rows 64 --prompt 10 --shortest 2 --longest 5 --layers 2 --hidden 64 --vocab 259
--out bench/results/packing_short_rows.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from logprob import build_model, interleaved, machine  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "packing.json"


def ragged_batch(rows: int, prompt: int, shortest: int, longest: int, vocab: int):
    """Full prompts of ``prompt`` tokens, responses log-uniform in [shortest, longest]."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    logs = torch.empty(rows).uniform_(math.log(shortest), math.log(longest), generator=g)
    lengths = logs.exp().round().long().clamp(shortest, longest)
    width = int(lengths.max())
    valid = torch.arange(width)[None, :] < lengths[:, None]
    return Batch(
        prompt_ids=torch.randint(0, vocab, (rows, prompt), generator=g),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        response_ids=torch.randint(0, vocab, (rows, width), generator=g) * valid,
        response_lengths=lengths,
        response_mask=valid.float(),
        group_id=torch.arange(rows),
        advantages=torch.randn(rows, width, generator=g) * valid,
    )


def padded_tokens(batch, budget: int) -> int:
    """Tokens the padded layout computes: rows x width of each of its micro-batches."""
    from megarl.megatron_runtime.micro_batches import MicroBatching, sequence_lengths

    lengths = sequence_lengths(batch).tolist()
    (groups,) = MicroBatching(None, budget, False).replica_groups(batch, 1)
    return sum(len(g) * max(lengths[r] for r in g) for g in groups)


def hf_logprobs(model, batch) -> torch.Tensor:
    """Each row alone, real tokens only: ``[B, R]`` log-probs of the response tokens."""
    out = torch.zeros(batch.response_ids.shape)
    p = batch.prompt_len
    with torch.no_grad():
        for i, n in enumerate(batch.response_lengths.tolist()):
            seq = torch.cat([batch.prompt_ids[i], batch.response_ids[i, :n]])[None]
            logits = model(seq).logits[0, p - 1 : -1].float()  # [n, V]
            out[i, :n] = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[i, :n, None])[:, 0]
    return out


def pg_loss(batch, outputs):
    mask = batch.response_mask.to(outputs.logprobs.dtype)
    loss_sum = -(batch.advantages.to(mask.dtype) * outputs.logprobs * mask).sum()
    count = mask.sum()
    return loss_sum, count, {"actor/pg_loss": torch.stack([loss_sum.detach(), count])}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--shortest", type=int, default=32)
    ap.add_argument("--longest", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=4096, help="actor.max_tokens_per_gpu of both sides")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON result goes (default: the recorded one)")
    return ap.parse_args()


def main() -> None:
    args = parse()
    # A CPU bench (the HF side runs on the CPU): the worker too, also on a GPU box. Set before
    # anything asks torch for a GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29535"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from transformers import AutoModelForCausalLM

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig, OptimizerConfig
    from megarl.data.batch import TokenRows

    info = machine()
    batch = ragged_batch(args.rows, args.prompt, args.shortest, args.longest, args.vocab)
    real = int((batch.prompt_lengths + batch.response_lengths).sum())
    padded = padded_tokens(batch, args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", args.layers, args.hidden, 8, 2, args.vocab)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        workers = {
            packed: PolicyWorker(path, ActorConfig(micro_batch_size=None, max_tokens_per_gpu=args.budget, pack_sequences=packed,
                                                   optimizer=OptimizerConfig(lr=1e-7)), "float32", seed=0)
            for packed in (True, False)
        }  # fmt: skip
    (lp_packed, lp_padded, lp_hf), results = interleaved(
        [lambda: workers[True].compute_logprobs(batch, 1.0), lambda: workers[False].compute_logprobs(batch, 1.0),
         lambda: hf_logprobs(hf, batch)], args.repeats)  # fmt: skip
    logprobs = [TokenRows.assemble([r], len(batch), batch.response_len)["logprobs"] for r in results[:2]]
    diff = max(float((lp - results[2]).abs().max()) for lp in logprobs)
    (tr_packed, tr_padded), _ = interleaved([lambda: workers[True].update(batch, pg_loss),
                                             lambda: workers[False].update(batch, pg_loss)], args.repeats)  # fmt: skip
    ratio = padded / real
    table = {
        "logprobs": {"packed_s": lp_packed, "padded_s": lp_padded, "hf_s": lp_hf,
                     "speedup_vs_padded": statistics.median(b / a for a, b in zip(lp_packed, lp_padded)),
                     "speedup_vs_hf": statistics.median(b / a for a, b in zip(lp_packed, lp_hf))},
        "train_step": {"packed_s": tr_packed, "padded_s": tr_padded,
                       "speedup_vs_padded": statistics.median(b / a for a, b in zip(tr_packed, tr_padded))},
    }  # fmt: skip
    info["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(f"{args.rows} rows, {real} real tokens; padded computes {padded} (padding ratio {ratio:.2f}); "
          f"target speed-up >= 0.7 x {ratio:.2f} = {0.7 * ratio:.2f}")
    print(f"{'work':<12}{'packed s':>10}{'padded s':>10}{'HF s':>8}{'packed/padded':>15}{'vs HF':>8}")
    for work, row in table.items():
        hf_s = f"{statistics.median(row['hf_s']):.2f}" if "hf_s" in row else "-"
        vs_hf = f"{row['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in row else "-"
        print(f"{work:<12}{statistics.median(row['packed_s']):>10.2f}{statistics.median(row['padded_s']):>10.2f}"
              f"{hf_s:>8}{row['speedup_vs_padded']:>14.2f}x{vs_hf:>8}")  # fmt: skip
    print(f"median of {args.repeats} interleaved rounds; max |log-prob diff| vs HF {diff:.1e}; "
          f"load {info['load_avg_1m']} -> {info['load_avg_1m_after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": info, "config": {**vars(args), "out": str(args.out)}, "real_tokens": real, "padded_tokens": padded,
        "padding_ratio": ratio, "target_speedup": 0.7 * ratio, "results": table, "max_abs_logprob_diff_vs_hf": diff,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
