"""Benchmark: how far apart engine and trainer log-probs are after honest bf16 pushes.

This is the noise floor that ``rollout.weight_sync.max_logprob_diff`` (the post-push check,
megarl/weight_sync/logprob_check.py) must sit above, and how far above it corrupted pushes land.

Per configuration (model x layout), two gloo processes (one thread each) run the real stack:
the Megatron policy (``PolicyWorker``, bf16, TP=2 or PP=2) and, on rank 0, the torch engine
(``TorchEngine``, bf16) fed by ``InProcessTransport`` over ``WeightStream(policy.export_weights)``.
Each push is followed by the check itself (``PostPushCheck``: the engine samples short responses
to the probe prompts at the run's temperature, full distribution, the policy scores the same
tokens, ``compare_logprobs`` gives the mean and max |diff|); between pushes the policy takes one
real optimizer step (NLL of fixed target responses), so every push carries new weights.

Models: the CPU demo's tiny model (``DEMO_MODEL``, its digit-reversal prompts, T=1, 4 new
tokens, lr 1e-3, as ``configs/tiny_grpo.yaml``) and a random-init model of the Qwen2.5-0.5B
shape (byte-level tokenizer, short raw-text prompts, T=1, 32 new tokens, lr 1e-5).

After the clean pushes, corrupted weights (one tensor scaled, or q/k rows swapped in one layer)
are written into the engine in place (what a push carrying that corruption leaves there) and the
same check is run: how far each corruption lands above the noise floor.

``--long N`` adds a tiny/tp2 run of N pushes (reported, not used for the default): does the
noise floor keep growing as the model trains?

Prints a table and merges the configurations run into bench/results/logprob_check.json
(machine and load per configuration); bench/results/logprob_check.md discusses the numbers.
Recorded with ``--models tiny`` then ``--models qwen05 --long 300`` (the 0.5B shape: ~35 and
~45 min for 20 pushes at TP=2 and PP=2: bf16 matmuls run at ~1 GFLOP/s on this CPU).

    .venv/bin/python bench/logprob_check.py [--models tiny,qwen05] [--layouts tp2,pp2]
        [--pushes 20] [--pushes-qwen05 N] [--long N] [--small] [--report]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "logprob_check.json"
QWEN05 = dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, ffn_hidden_size=4864,
              vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"  # the tensor the tests scale (chosen before measuring)
SCALES = (1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0)
# Raw text, no chat template: the byte-level tokenizer spends a token per byte (a template alone
# is ~30), and a bf16 0.5B forward costs ~1 s a token per rank on this CPU (no bf16 matmul units).
TEXT_PROMPTS = ("The capital of France is", "Three primes: 2, 3,", "Once upon a time", "def add(a, b):")
TEXT_TARGETS = (" Paris.", " 5, 7.")


@dataclasses.dataclass
class Plan:
    """Everything the ranks need (picklable)."""

    config: str
    model_dir: str
    layout: str
    pushes: int
    temperature: float
    max_new_tokens: int
    lr: float
    probe_prompts: list[list[int]]
    train_rows: list[list[tuple[list[int], list[int]]]]  # per optimizer step: (prompt, response) rows
    corruptions: list[dict]
    corruption_probes: int
    bucket_mb: float = 512
    seed: int = 1


# ---------------------------------------------------------------- models and data (main process)


def build_qwen05(out: Path, shape: dict) -> Path:
    """A random-init HF directory of the given Qwen2 shape (bf16) with the byte-level tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megarl.models.tiny import build_tokenizer, tiny_hf_config

    tok = build_tokenizer()
    shape = {k: v for k, v in shape.items() if k != "arch"}
    cfg = tiny_hf_config("qwen2", eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_data(model_dir: Path, steps: int) -> tuple[list[list[int]], list]:
    """The demo's probe (the first 4 held-out prompts) and 32 training rows per step, each the
    prompt and its correct answer (reversed digits + end of turn)."""
    from transformers import AutoTokenizer

    from megarl.data.prompts import PromptBuilder
    from megarl.data.tasks import reverse_digits_rows

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    builder = PromptBuilder(tok, max_prompt_length=16)
    train, val = reverse_digits_rows()

    def ids(rows):
        return builder.tokenize([builder.render(r["prompt"]) for r in rows])

    probe = ids(val[:4])
    steps_rows = []
    for s in range(steps):
        start = 32 * s % (len(train) - 31)  # a long run cycles through the training strings
        rows = train[start : start + 32]
        answers = [tok(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
        steps_rows.append(list(zip(ids(rows), answers, strict=True)))
    return probe, steps_rows


def text_data(model_dir: Path, steps: int) -> tuple[list[list[int]], list]:
    """Four short raw-text prompts; each step trains on the first two with short answers."""
    from transformers import AutoTokenizer

    from megarl.data.prompts import PromptBuilder

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    builder = PromptBuilder(tok, max_prompt_length=256, apply_chat_template=False)
    probe = builder.tokenize([builder.render(p) for p in TEXT_PROMPTS])
    answers = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in TEXT_TARGETS]
    rows = list(zip(probe[: len(answers)], answers, strict=True))
    return probe, [rows for _ in range(steps)]


def corruptions(names: list[str], layers: list[int], every_tensor: bool) -> list[dict]:
    """The scale ladder of DOWN_PROJ, q/k swaps, and (``every_tensor``) every tensor x 1.01."""
    out = [dict(kind="scale", name=DOWN_PROJ, scale=s) for s in SCALES]
    out += [dict(kind="swap_qk", layer=i) for i in layers]
    if every_tensor:
        out += [dict(kind="scale", name=n, scale=1.01) for n in names if n != DOWN_PROJ]
    return out


# ---------------------------------------------------------------- the ranks


class GatheredPolicy:
    """The trainer's side of the check: the policy's TokenRows assembled on every rank (what the
    controller's policy client does), so every rank runs the same check."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def compute_logprobs(self, batch, temperature: float) -> torch.Tensor:
        import torch.distributed as dist

        from megarl.data.batch import TokenRows

        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.policy.compute_logprobs(batch, temperature))
        return TokenRows.assemble(parts, len(batch), batch.response_len)["logprobs"]


def broadcast_generate(engine, prompts: list[list[int]], params):
    """The engines' side: rank 0's engine generates, every rank gets the Batch."""
    import torch.distributed as dist

    from megarl.rollout.batching import batch_from_generations

    box = [None]
    if engine is not None:
        box[0] = batch_from_generations(prompts, engine.generate(prompts, params), params.n)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def nll_loss(batch, outputs):
    """Token-mean NLL of the target responses: a real gradient on every weight (reported as
    ``actor/pg_loss``, a catalogued sum/count metric)."""
    mask = batch.response_mask
    loss_sum, count = -(outputs.logprobs * mask).sum(), mask.sum()
    return loss_sum, count, {"actor/pg_loss": torch.stack([loss_sum.detach(), count])}


def train_batch(rows: list[tuple[list[int], list[int]]]):
    from megarl.engines.base import GenerationResult
    from megarl.rollout.batching import batch_from_generations

    results = [GenerationResult(i, list(r), [0.0] * len(r), "stop") for i, (_, r) in enumerate(rows)]
    return batch_from_generations([p for p, _ in rows], results, 1)


def build_stack(rank: int, plan: Plan):
    """(policy, engine or None, transport, check) as a run builds them, at bf16."""
    from megarl.actors.policy import PolicyWorker
    from megarl.config.rollout_sections import WeightSyncConfig
    from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig
    from megarl.engines.base import SamplingParams
    from megarl.engines.torch_engine import TorchEngine
    from megarl.weight_sync.logprob_check import PostPushCheck
    from megarl.weight_sync.stream import MIB, WeightStream
    from megarl.weight_sync.transports import InProcessTransport

    cfg = ActorConfig(parallel=ParallelConfig(**LAYOUTS[plan.layout]), micro_batch_size=8,
                      optimizer=OptimizerConfig(lr=plan.lr, clip_grad=1.0))  # fmt: skip
    policy = PolicyWorker(plan.model_dir, cfg, dtype="bfloat16", seed=plan.seed)
    engine = TorchEngine(plan.model_dir, dtype="bfloat16") if rank == 0 else None
    gather = int(WeightSyncConfig().gather_mb * MIB)
    export = partial(policy.export_weights, gather_bytes=gather, collect="leader")  # as build_transport wires in_process
    transport = InProcessTransport(WeightStream(export, plan.bucket_mb), [engine] if engine else [])
    transport.connect(None)
    sampling = SamplingParams(temperature=plan.temperature, max_new_tokens=plan.max_new_tokens, seed=plan.seed)
    # max_diff=inf: record every push (compare_logprobs still refuses NaN).
    check = PostPushCheck(partial(broadcast_generate, engine), GatheredPolicy(policy), plan.probe_prompts,
                          sampling, max_diff=math.inf)  # fmt: skip
    return policy, engine, transport, check


def clean_pushes(plan: Plan, policy, transport, check) -> list[dict]:
    """``plan.pushes`` pushes, each checked; one optimizer step before every push but the first."""
    import torch.distributed as dist

    records = []
    for version in range(1, plan.pushes + 1):
        update_s = 0.0
        if version > 1:
            start = time.perf_counter()
            metrics = policy.update(train_batch(plan.train_rows[version - 2]), nll_loss, temperature=plan.temperature)
            update_s = time.perf_counter() - start
        dist.barrier()
        push = transport.push(version)
        start = time.perf_counter()
        diff = check(version)
        record = dict(version=version, mean=diff["weight_sync/logprob_diff"], max=diff["weight_sync/logprob_diff_max"],
                      push_s=push["weight_sync/seconds"], check_s=time.perf_counter() - start, update_s=update_s,
                      loss=metrics["actor/pg_loss"] if version > 1 else None,
                      grad_norm=metrics["actor/grad_norm"] if version > 1 else None)  # fmt: skip
        records.append(record)
        if dist.get_rank() == 0:
            print(f"[{plan.config}] push {version}: mean {record['mean']:.3g} max {record['max']:.3g} "
                  f"loss {record['loss']} (push {record['push_s']:.1f} s, check {record['check_s']:.1f} s, update {update_s:.1f} s)", flush=True)  # fmt: skip
    return records


def corrupt(engine, spec: dict) -> dict[str, torch.Tensor]:
    """Write ``spec``'s corruption into the engine's weights; returns the originals to restore."""
    state = engine.model.state_dict()
    if spec["kind"] == "scale":
        saved = {spec["name"]: state[spec["name"]].clone()}
        state[spec["name"]].mul_(spec["scale"])
        return saved
    attn = f"model.layers.{spec['layer']}.self_attn"
    saved = {}
    for suffix in ("weight", "bias"):
        q, k = state[f"{attn}.q_proj.{suffix}"], state[f"{attn}.k_proj.{suffix}"]
        saved |= {f"{attn}.q_proj.{suffix}": q.clone(), f"{attn}.k_proj.{suffix}": k.clone()}
        rows = k.shape[0]  # GQA: k is the size of the first num_kv_heads q heads; swap those
        q_head = q[:rows].clone()
        q[:rows].copy_(k)
        k.copy_(q_head)
    return saved


def corrupted_checks(plan: Plan, engine, check) -> list[dict]:
    """Each corruption in the engine, checked ``plan.corruption_probes`` times (other samples)."""
    records = []
    for spec in plan.corruptions:
        saved = corrupt(engine, spec) if engine is not None else {}
        diffs = [check(plan.pushes + 1 + j) for j in range(plan.corruption_probes)]
        if engine is not None:
            state = engine.model.state_dict()
            for name, value in saved.items():
                state[name].copy_(value)
        records.append(dict(spec, mean=[d["weight_sync/logprob_diff"] for d in diffs],
                            max=[d["weight_sync/logprob_diff_max"] for d in diffs]))  # fmt: skip
    return records


def clean_probes(plan: Plan, check) -> list[dict]:
    """The final (clean) weights checked with the corruption probes' seeds: their baseline."""
    diffs = [check(plan.pushes + 1 + j) for j in range(plan.corruption_probes)]
    return [dict(mean=d["weight_sync/logprob_diff"], max=d["weight_sync/logprob_diff_max"]) for d in diffs]


def rank_main(rank: int, port: int, plan: Plan, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo, CPU tensors  # fmt: skip
    torch.set_num_threads(1)
    from megarl.parallel.groups import destroy_parallel

    try:
        policy, engine, transport, check = build_stack(rank, plan)
        pushes = clean_pushes(plan, policy, transport, check)
        baseline = clean_probes(plan, check) if plan.corruptions else []
        corrupted = corrupted_checks(plan, engine, check)
        if rank == 0:
            names = [n for n, _ in engine.model.named_parameters()]
            Path(out).write_text(json.dumps(dict(pushes=pushes, baseline=baseline, corrupted=corrupted, names=names)))
    finally:
        destroy_parallel()


# ---------------------------------------------------------------- main process


def readable_ceil(x: float) -> float:
    """The smallest of 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k that is >= x."""
    exp = math.floor(math.log10(x))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * 10**exp >= x * (1 - 1e-9):
            return float(f"{m * 10**exp:.3g}")
    raise AssertionError(x)


def plan_for(model: str, layout: str, model_dir: Path, pushes: int, probes: int, small: bool) -> Plan:
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(str(model_dir)).num_hidden_layers
    if model == "tiny":
        probe, rows = tiny_data(model_dir, pushes)
        names = param_names(model_dir)
        specs = corruptions(names, list(range(layers)), every_tensor=True) if probes else []
        return Plan(f"tiny/{layout}", str(model_dir), layout, pushes, 1.0, 4, 1e-3, probe, rows, specs, probes)
    probe, rows = text_data(model_dir, pushes)
    specs = corruptions([], [0, layers - 1], every_tensor=False) if probes else []
    specs = [s for s in specs if s.get("scale", 0) in (0, 1.01, 1.1, 2.0)]  # each check costs ~40 s
    specs += [dict(kind="scale", name=n, scale=1.01) for n in ("model.norm.weight", "model.embed_tokens.weight")] if probes else []
    return Plan(f"{'small' if small else 'qwen05'}/{layout}", str(model_dir), layout, pushes, 1.0, 32, 1e-5,
                probe, rows, specs, probes)  # fmt: skip


def param_names(model_dir: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    return [n for n, _ in AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters()]


def run_plan(plan: Plan, tmp: Path) -> dict:
    raw = tmp / f"raw-{plan.layout}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = describe()
    start = time.perf_counter()
    mp.spawn(rank_main, args=(port, plan, str(raw)), nprocs=2, join=True)
    data = json.loads(raw.read_text())
    return dict(summarise(plan, data), machine_before=before, load_avg_after=os.getloadavg(),
                wall_s=time.perf_counter() - start)  # fmt: skip


def summarise(plan: Plan, data: dict) -> dict:
    pushes = data["pushes"]
    means, maxes = [p["mean"] for p in pushes], [p["max"] for p in pushes]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return dict(
        pushes=len(pushes), temperature=plan.temperature, max_new_tokens=plan.max_new_tokens, lr=plan.lr,
        probe_prompts=len(plan.probe_prompts), train_rows_per_step=len(plan.train_rows[0]),
        mean_of_means=sum(means) / len(means), worst_mean=max(means), worst_max=max(maxes),
        median_push_s=med([p["push_s"] for p in pushes]), median_check_s=med([p["check_s"] for p in pushes]),
        median_update_s=med([p["update_s"] for p in pushes[1:]] or [0.0]),
        per_push=pushes, clean_baseline=data["baseline"], corrupted=data["corrupted"],
    )  # fmt: skip


def summary(configs: dict) -> dict:
    """The default (3x the worst mean of the 20-push configurations, rounded up) and which
    corruptions it refuses; an ``extra`` configuration (the long run) is reported, not used."""
    measured = [c for c in configs.values() if "extra" not in c]
    worst_mean = max(c["worst_mean"] for c in measured)
    worst_max = max(c["worst_max"] for c in measured)
    default = readable_ceil(3 * worst_mean)
    max_bound = readable_ceil(3 * worst_max)
    detect = {}
    for name, c in configs.items():
        detect[name] = [
            dict(what=describe_spec(s), means=s["mean"], maxes=s["max"], refused_by_mean=all(m > default for m in s["mean"]),
                 refused_by_max=all(m > max_bound for m in s["max"]))  # fmt: skip
            for s in c["corrupted"]
        ]
    extra = {name: dict(worst_mean=c["worst_mean"], worst_max=c["worst_max"], note=c["extra"])
             for name, c in configs.items() if "extra" in c}  # fmt: skip
    return dict(worst_mean=worst_mean, worst_max=worst_max, default_max_logprob_diff=default,
                rule="3 x the worst mean over the 20-push configurations, rounded up to 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k",
                max_diff_bound_if_max_were_checked=max_bound, extra_runs=extra, corrupted=detect)  # fmt: skip


def describe_spec(s: dict) -> str:
    if s["kind"] == "scale":
        return f"{s['name']} x {s['scale']}"
    return f"layer {s['layer']}: k_proj swapped with the first num_kv_heads heads of q_proj"


SMALL = dict(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=256,
             vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512)  # fmt: skip


def build_model(model: str, tmp: Path, small: bool) -> Path:
    from megarl.commands.demo import DEMO_MODEL
    from megarl.models.tiny import build_tiny_model

    if model == "tiny":
        return build_tiny_model(tmp / "tiny", seed=0, **DEMO_MODEL)
    return build_qwen05(tmp / model, SMALL if small else QWEN05)


def print_table(configs: dict, result: dict) -> None:
    print(f"\n{'config':<12}{'pushes':>7}{'mean of means':>15}{'worst mean':>12}{'worst max':>11}"
          f"{'push s':>8}{'check s':>9}{'update s':>10}{'load 1m start/end':>19}")  # fmt: skip
    for name, c in configs.items():
        print(f"{name:<12}{c['pushes']:>7}{c['mean_of_means']:>15.3g}{c['worst_mean']:>12.3g}{c['worst_max']:>11.3g}"
              f"{c['median_push_s']:>8.1f}{c['median_check_s']:>9.1f}{c['median_update_s']:>10.1f}"
              f"{c['machine_before']['load_avg_1m']:>13.2f} /{c['load_avg_after'][0]:>5.2f}")  # fmt: skip
    print(f"\nworst mean {result['worst_mean']:.3g} -> default max_logprob_diff {result['default_max_logprob_diff']}"
          f" (a max-based bound would be {result['max_diff_bound_if_max_were_checked']})")  # fmt: skip
    for name, e in result["extra_runs"].items():
        print(f"{name} (not in the default): worst mean {e['worst_mean']:.3g}, worst max {e['worst_max']:.3g}")
    for name, rows in result["corrupted"].items():
        print(f"\n{name}: corrupted engine weights (mean diffs per probe; refused by mean / by max bound)")
        for row in rows:
            means = ", ".join(f"{m:.3g}" for m in row["means"])
            maxes = ", ".join(f"{m:.3g}" for m in row["maxes"])
            print(f"  {row['what']:<72} mean [{means}] max [{maxes}] {row['refused_by_mean']}/{row['refused_by_max']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen05")
    parser.add_argument("--layouts", default="tp2,pp2")
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--pushes-qwen05", type=int, default=None, help="fewer pushes for the 0.5B shape")
    parser.add_argument("--probes", type=int, default=3, help="checks per corruption (tiny; 2 for qwen05)")
    parser.add_argument("--no-corruptions-qwen05", action="store_true")
    parser.add_argument("--long", type=int, default=0, help="also a tiny/tp2 run this many pushes long (not in the default)")
    parser.add_argument("--small", action="store_true", help="a small model instead of the 0.5B shape, not recorded")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--report", action="store_true", help="only re-summarise and print the stored results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    stored = json.loads(out.read_text()) if out.is_file() and not args.small else {}
    configs = stored.get("configs", {})
    if args.report:
        write(out, configs)
        print_table(configs, summary(configs))
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in args.models.split(","):
            model_dir = build_model(model, tmp, args.small)
            pushes = args.pushes if model == "tiny" else (args.pushes_qwen05 or args.pushes)
            probes = args.probes if model == "tiny" else (0 if args.no_corruptions_qwen05 else 2)
            for layout in args.layouts.split(","):
                plan = plan_for(model, layout, model_dir, pushes, probes if layout == "tp2" else 0, args.small)
                configs[plan.config] = run_plan(plan, tmp)
                if not args.small:  # after every configuration: a long run keeps what it measured
                    write(out, configs)
        if args.long:
            model_dir = build_model("tiny", tmp, args.small)
            plan = dataclasses.replace(plan_for("tiny", "tp2", model_dir, args.long, 0, args.small), config="tiny/tp2-long")
            configs[plan.config] = run_plan(plan, tmp) | {"extra": f"{args.long} pushes: does the noise floor keep growing?"}
            if not args.small:
                write(out, configs)
    result = summary(configs)
    print_table(configs, result)
    if not args.small:
        print(f"wrote {out}")


def write(out: Path, configs: dict) -> None:
    result = {
        "benchmark": "post-push log-prob check, bf16: Megatron PolicyWorker (2 gloo processes, 1 thread each) -> "
        "torch engine in-process, PostPushCheck after every push, one optimizer step between pushes",
        "configs": configs,
    } | summary(configs)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
