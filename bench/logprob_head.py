"""The LM head's memory and time: chunked log-probs against the whole logits at once, on CPU.

Both sides compute the log-probs and entropy of N response tokens from their last hidden
states ``[N, h]`` and the output layer's weight ``[V, h]``, then back-propagate a loss of both
into the hidden states and the weight (what a policy update does):

- ``whole``: the head before chunking: ``logits = hidden @ W^T`` for every token, then an fp32
  ``log_softmax`` (``[N, V]`` buffers in the model dtype and in fp32, with their gradients);
- ``chunked``: ``megarl.megatron_runtime.logprobs.linear_logprobs`` with
  ``chunk_tokens`` tokens at a time.

Shapes are Qwen2.5-0.5B's head (hidden 896, vocabulary 151936) at TP=1, fp32. Peak memory:
each (side, N) runs forward + backward in a fresh process, and the process's peak resident
memory (VmHWM) minus its resident memory before the head ran is reported. Time: one process,
the two sides interleaved, REPEATS runs each, the median of the per-pair ratios. Writes
bench/results/logprob_head.json and .md with the machine and its load.

    OMP_NUM_THREADS=2 .venv/bin/python bench/logprob_head.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import describe  # noqa: E402  (bench/machine.py)

from megarl.megatron_runtime.logprobs import linear_logprobs

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, VOCAB, CHUNK = 896, 151936, 256
MEMORY_TOKENS = (256, 1024, 2048)
TIME_TOKENS, REPEATS = 512, 5


def _inputs(n: int):
    gen = torch.Generator().manual_seed(0)
    hidden = (0.05 * torch.randn(n, HIDDEN, generator=gen)).requires_grad_()
    weight = (0.05 * torch.randn(VOCAB, HIDDEN, generator=gen)).requires_grad_()
    return hidden, weight, torch.randint(0, VOCAB, (n,), generator=gen)


def _whole(hidden, weight, targets):
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)  # [N, V]
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _chunked(hidden, weight, targets):
    return linear_logprobs(hidden, weight, targets, chunk_tokens=CHUNK, with_entropy=True)


SIDES = {"whole": _whole, "chunked": _chunked}


def _step(side: str, n: int, inputs=None) -> float:
    """One forward + backward; returns seconds."""
    hidden, weight, targets = inputs or _inputs(n)
    start = time.perf_counter()
    lp, ent = SIDES[side](hidden, weight, targets)
    torch.autograd.grad(lp.sum() + 0.01 * ent.sum(), [hidden, weight])
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(side: str, n: int) -> None:
    inputs = _inputs(n)
    before = _status_kib("VmRSS")
    _step(side, n, inputs)
    print(json.dumps({"peak_mib": (_status_kib("VmHWM") - before) / 1024}))


def _peak_mib(side: str, n: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", side, str(n)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    machine = describe()
    memory = {side: {n: _peak_mib(side, n) for n in MEMORY_TOKENS} for side in SIDES}
    inputs = _inputs(TIME_TOKENS)
    _step("whole", TIME_TOKENS, inputs), _step("chunked", TIME_TOKENS, inputs)  # warm-up
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(REPEATS):
        for side in SIDES:
            times[side].append(_step(side, TIME_TOKENS, inputs))
    ratios = [c / w for c, w in zip(times["chunked"], times["whole"])]
    result = {
        "machine": machine | {"load_avg_1m_end": round(os.getloadavg()[0], 2)},
        "shape": {"hidden": HIDDEN, "vocab": VOCAB, "chunk_tokens": CHUNK, "dtype": "float32"},
        "peak_mib": memory,
        "time_tokens": TIME_TOKENS,
        "seconds": times,
        "median_time_ratio_chunked_over_whole": statistics.median(ratios),
    }
    _write(result)


def _write(result: dict) -> None:
    lines = [
        f"# LM head: chunked log-probs vs whole logits ({result['machine']['date']})",
        "",
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, torch {result['machine'].get('torch')}, "
        f"load {result['machine']['load_avg_1m']} -> {result['machine']['load_avg_1m_end']}.",
        f"Head: hidden {HIDDEN}, vocabulary {VOCAB}, fp32, chunk {CHUNK} tokens; forward + backward.",
        "",
        "| tokens | whole peak MiB | chunked peak MiB | chunked / whole |",
        "|---:|---:|---:|---:|",
    ]
    for n in MEMORY_TOKENS:
        w, c = result["peak_mib"]["whole"][n], result["peak_mib"]["chunked"][n]
        lines.append(f"| {n} | {w:.0f} | {c:.0f} | {c / w:.2f} |")
    lines += ["", f"Time at {TIME_TOKENS} tokens, median of {REPEATS} interleaved pairs: chunked / whole = "
              f"{result['median_time_ratio_chunked_over_whole']:.2f}", ""]
    out = ROOT / "bench" / "results"
    (out / "logprob_head.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "logprob_head.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
