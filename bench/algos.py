"""megarl.algos against verl's ``verl.trainer.ppo.core_algos`` on identical [512, 4096] fp32 CPU inputs.

Every advantage estimator, policy loss (forward + backward), loss aggregation, KL estimator,
the value loss and the TIS weights are timed on both sides in the same process, with the same
thread count (1: the box is shared; both sides get the same), best of several runs after a
warm-up. Where the definitions coincide, the max abs difference of the outputs over valid
tokens is printed too. Writes bench/results/algos.json and bench/results/algos.md.

verl lives in a separate venv, never a megarl dependency:

    python3 -m venv .bench-venv
    .bench-venv/bin/pip install torch==2.13.0
    .bench-venv/bin/pip install -e . --no-deps
    .bench-venv/bin/pip install verl --no-deps
    .bench-venv/bin/pip install tensordict omegaconf codetiming orjson numpy pydantic pyyaml \
        ray transformers
    OMP_NUM_THREADS=1 .bench-venv/bin/python bench/algos.py

Run with .venv/bin/python instead and only megarl's side is timed (the script says why verl
is missing). Targets: GAE >= 5x faster than verl's, every other function no slower.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from machine import describe  # noqa: E402  (bench/machine.py)

from megarl.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    ModelOutputs,
    aggregate,
    kl_estimate,
    make_value_loss_fn,
    tis_weights,
    token_rewards_from_scores,
)
from megarl.algos.losses import POLICY_LOSSES, make_policy_loss_fn
from megarl.config.algorithm_sections import AlgorithmConfig, ClipConfig
from megarl.data.batch import Batch

ROOT = Path(__file__).resolve().parents[1]
B, R, GROUP = 512, 4096, 8
THREADS = 1
BUDGET_S = 6.0  # seconds of timed runs per function, both sides together (at least 2 runs each)
MAX_REPEATS = 50

try:
    import verl.trainer.ppo.core_algos as verl_core
    from verl.trainer.config import AlgoConfig as VerlAlgoConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.config.actor import ActorConfig as VerlActorConfig

    VERL_MISSING = ""
except Exception as exc:  # any import failure: still time megarl's side
    verl_core = None
    VERL_MISSING = (
        f"verl not importable ({type(exc).__name__}: {exc}); run with .bench-venv/bin/python"
    )


@dataclass
class Case:
    name: str
    megarl: Callable[[], Any]
    verl: Callable[[], Any] | None = None
    diff: Callable[[Any, Any], float] | None = None  # max abs diff where definitions coincide
    note: str = ""


def make_data(seed: int = 0) -> dict[str, Any]:
    """Ragged responses (lengths 1..R), groups of GROUP, 0/1 scores, log-probs around -1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (B,), generator=g).float()
    old = -torch.rand(B, R, generator=g) * 2
    d = {
        "lengths": lengths,
        "mask": mask,
        "scores": scores,
        "group_id": torch.arange(B) // GROUP,
        "uids": np.array([f"uid-{i // GROUP}" for i in range(B)], dtype=object),
        "rewards": token_rewards_from_scores(scores, lengths, mask),
        "values": torch.randn(B, R, generator=g),
        "old": old,
        "logp": old + torch.randn(B, R, generator=g) * 0.1,
        "ref": old + torch.randn(B, R, generator=g) * 0.1,
        "rollout": old + torch.randn(B, R, generator=g) * 0.05,
        "adv": torch.randn(B, R, generator=g) * mask,
        "baseline": torch.rand(B, generator=g),
    }
    return d


def time_pair(
    ours: Callable[[], Any], theirs: Callable[[], Any] | None
) -> tuple[list[float], Any, Any]:
    """Best wall time of each side, runs interleaved (ours, theirs, ours, ...) so that load
    changes on the shared machine hit both alike. Also returns both first outputs."""
    fns = [ours] if theirs is None else [ours, theirs]
    outs = [fn() for fn in fns]  # warm-up, and the outputs for the comparison
    best = [float("inf")] * len(fns)
    spent, runs = 0.0, 0
    while runs < MAX_REPEATS and (spent < BUDGET_S or runs < 2):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            best[k] = min(best[k], elapsed)
            spent += elapsed
        runs += 1
    return best, outs[0], outs[-1] if theirs is not None else None


def masked_diff(mask: torch.Tensor) -> Callable[[Any, Any], float]:
    def diff(a: Any, b: Any) -> float:
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        return float(((a - b).abs() * mask).max())

    return diff


def scalar_diff(a: Any, b: Any) -> float:
    return abs(float(a) - float(b))


# ---- cases ------------------------------------------------------------------------------
def estimator_cases(d: dict[str, Any]) -> list[Case]:
    mask, rewards, uids = d["mask"], d["rewards"], d["uids"]
    inputs = AdvantageInputs(rewards, mask, d["group_id"], d["values"], d["baseline"])
    cfg = AlgorithmConfig(gamma=1.0, lam=0.95)

    def ours(name: str) -> Callable[[], Any]:
        fn = ADVANTAGE_ESTIMATORS.get(name)
        return lambda: fn(inputs, cfg)

    v = verl_core
    vcfg = VerlAlgoConfig(gamma=1.0, lam=0.95) if v else None
    diff = masked_diff(mask)
    return [
        Case("adv gae", ours("gae"), v and (lambda: v.compute_gae_advantage_return(rewards, d["values"], mask, 1.0, 0.95)), diff),
        Case("adv grpo", ours("grpo"), v and (lambda: v.compute_grpo_outcome_advantage(rewards, mask, uids)), diff, "verl: registered 'grpo'"),
        Case("adv grpo (vs verl vectorized)", ours("grpo"), v and (lambda: v.compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)), diff),
        Case("adv dr_grpo", ours("dr_grpo"), v and (lambda: v.compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False)), diff),
        Case("adv rloo", ours("rloo"), v and (lambda: v.compute_rloo_outcome_advantage(rewards, mask, uids)), diff, "verl: registered 'rloo'"),
        Case("adv rloo (vs verl vectorized)", ours("rloo"), v and (lambda: v.compute_rloo_vectorized_outcome_advantage(rewards, mask, uids)), diff),
        Case("adv reinforce_plus_plus", ours("reinforce_plus_plus"), v and (lambda: v.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=vcfg)), diff),
        Case("adv reinforce_plus_plus_baseline", ours("reinforce_plus_plus_baseline"), v and (lambda: v.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids, config=vcfg)), diff),
        Case("adv remax", ours("remax"), v and (lambda: v.compute_remax_outcome_advantage(rewards, d["baseline"], mask, config=vcfg)), diff),
    ]  # fmt: skip


def _fwd_bwd(
    loss_fn: Callable[[torch.Tensor], torch.Tensor], logp0: torch.Tensor
) -> Callable[[], float]:
    def run() -> float:
        logp = logp0.clone().requires_grad_()
        loss = loss_fn(logp)
        loss.backward()
        return loss.item()

    return run


def policy_loss_cases(d: dict[str, Any]) -> list[Case]:
    mask, old, adv = d["mask"], d["old"], d["adv"]
    cases = []
    for name, verl_name, clip in (
        ("ppo", "vanilla", ClipConfig(high=0.28)),
        ("gspo", "gspo", ClipConfig(low=3e-4, high=4e-4)),
    ):
        fn = POLICY_LOSSES.get(name)

        def ours(logp: torch.Tensor, fn=fn, clip=clip) -> torch.Tensor:
            total, count = aggregate(fn(logp, old, adv, mask, clip).loss, mask, "token-mean", R)
            return total / count

        verl_fn = None
        if verl_core is not None:
            vcfg = VerlActorConfig(
                strategy="fsdp",
                rollout_n=GROUP,
                ppo_micro_batch_size_per_gpu=1,
                clip_ratio_low=clip.low,
                clip_ratio_high=clip.high,
                clip_ratio_c=clip.dual_c or 3.0,
            )
            policy = verl_core.get_policy_loss_fn(verl_name)
            verl_fn = _fwd_bwd(
                lambda lp, p=policy, c=vcfg: p(old, lp, adv, mask, "token-mean", c)[0], d["logp"]
            )
        cases.append(
            Case(
                f"loss {name} fwd+bwd",
                _fwd_bwd(ours, d["logp"]),
                verl_fn,
                scalar_diff,
                "verl also computes 3 metrics (.item())",
            )
        )
    return cases  # fmt: skip


def loss_fn_cases(d: dict[str, Any]) -> list[Case]:
    """The full LossFns the workers call (all metrics), against verl's nearest equivalents."""
    mask = d["mask"]
    batch = Batch(
        prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
        response_ids=torch.ones(B, R, dtype=torch.long), response_lengths=d["lengths"], response_mask=mask,
        group_id=d["group_id"], old_logprobs=d["old"], advantages=d["adv"], values=d["values"],
        returns=d["values"] + d["adv"],
    )  # fmt: skip
    policy = make_policy_loss_fn(AlgorithmConfig(clip={"high": 0.28}), R)
    value = make_value_loss_fn(AlgorithmConfig(clip={"value": 0.2}))

    def ours_policy(logp: torch.Tensor) -> torch.Tensor:
        total, count, _ = policy(batch, ModelOutputs(logp))
        return total / count

    def ours_value(vpred: torch.Tensor) -> torch.Tensor:
        total, count, _ = value(batch, ModelOutputs(vpred.detach(), values=vpred))
        return total / count

    vpred0 = d["values"] + 0.3 * d["adv"]
    verl_policy = verl_value = None
    if verl_core is not None:
        vcfg = VerlActorConfig(
            strategy="fsdp", rollout_n=GROUP, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28
        )
        verl_policy = _fwd_bwd(
            lambda lp: verl_core.compute_policy_loss_vanilla(
                d["old"], lp, d["adv"], mask, "token-mean", vcfg
            )[0],
            d["logp"],
        )
        verl_value = _fwd_bwd(
            lambda vp: verl_core.compute_value_loss(vp, batch.returns, d["values"], mask, 0.2)[0],
            vpred0,
        )
    return [
        Case("LossFn policy (ppo + 9 metrics) fwd+bwd", _fwd_bwd(ours_policy, d["logp"]), verl_policy, scalar_diff, "verl: vanilla loss + 3 metrics"),
        Case("LossFn value (clipped) fwd+bwd", _fwd_bwd(ours_value, vpred0), verl_value, scalar_diff),
    ]  # fmt: skip


def aggregation_cases(d: dict[str, Any]) -> list[Case]:
    mask, loss = d["mask"], d["adv"]

    def ours(mode: str) -> Callable[[], Any]:
        return lambda: (lambda s, c: s / c)(*aggregate(loss, mask, mode, R))

    def theirs(mode: str) -> Callable[[], Any] | None:
        if verl_core is None:
            return None
        return lambda: verl_core.agg_loss(loss, mask, mode, loss_scale_factor=R)

    modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    return [Case(f"agg {m}", ours(m), theirs(m), scalar_diff) for m in modes]


def kl_and_tis_cases(d: dict[str, Any]) -> list[Case]:
    mask, logp, ref = d["mask"], d["logp"], d["ref"]
    diff = masked_diff(mask)
    cases = []
    for ours_name, verl_name in (("k1", "k1"), ("k2", "mse"), ("k3", "low_var_kl"), ("abs", "abs")):
        theirs = (lambda n=verl_name: verl_core.kl_penalty(logp, ref, n)) if verl_core else None
        cases.append(
            Case(f"kl {ours_name}", lambda n=ours_name: kl_estimate(logp, ref, n), theirs, diff)
        )
    for level in ("token", "sequence"):

        def ours(lv: str = level) -> torch.Tensor:
            return tis_weights(logp, d["rollout"], mask, lv, 2.0)

        def theirs(lv: str = level) -> torch.Tensor:
            return compute_rollout_correction_weights(logp - d["rollout"], mask, lv, 2.0)[0]

        cases.append(
            Case(
                f"tis {level}",
                ours,
                theirs if verl_core else None,
                diff,
                "verl also computes its IS metrics",
            )
        )
    return cases


# ---- report -----------------------------------------------------------------------------
def run_case(case: Case) -> dict[str, Any]:
    best, ours_out, verl_out = time_pair(case.megarl, case.verl)
    ours_s = best[0]
    row: dict[str, Any] = {
        "name": case.name,
        "megarl_s": ours_s,
        "verl_s": None,
        "speedup": None,
        "max_abs_diff": None,
    }
    if case.verl is not None:
        verl_s = best[1]
        row.update(verl_s=verl_s, speedup=verl_s / ours_s)
        if case.diff is not None:
            row["max_abs_diff"] = case.diff(ours_out, verl_out)
    row["note"] = case.note
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print(f"{case.name:44} {ours_s * 1e3:10.2f} {fmt(row['verl_s'] and row['verl_s'] * 1e3, '10.2f'):>10} "
          f"{fmt(row['speedup'], '8.2f'):>8} {fmt(row['max_abs_diff'], '10.2e'):>10}", flush=True)  # fmt: skip
    return row


def machine() -> dict[str, Any]:
    verl = getattr(__import__("verl"), "__version__", "?") if verl_core else None
    return describe() | {"torch_threads": THREADS, "verl": verl}  # bench/machine.py

def write_results(rows: list[dict[str, Any]]) -> None:
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "shape": [B, R],
        "dtype": "float32",
        "verl_missing": VERL_MISSING or None,
        "rows": rows,
    }
    results = ROOT / "bench" / "results"
    (results / "algos.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"# megarl.algos vs verl core_algos, [{B}, {R}] fp32, CPU, {THREADS} thread",
        "",
        f"{out['date']}; {out['machine']['cpu']}, {out['machine']['cores']} cores, torch {out['machine']['torch']}, "
        f"verl {out['machine']['verl']}, load {out['machine']['load_avg_1m']}. Best of up to {MAX_REPEATS} runs.",
        "",
        "| function | megarl ms | verl ms | verl / megarl | max abs diff | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verl_ms = "-" if r["verl_s"] is None else f"{r['verl_s'] * 1e3:.2f}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        lines.append(
            f"| {r['name']} | {r['megarl_s'] * 1e3:.2f} | {verl_ms} | {speed} | {diff} | {r['note']} |"
        )
    lines += [
        "",
        "Both sides run interleaved in one process; verl / megarl > 1 means megarl is faster. Rows",
        "near 1x under ~2 ms (kl k1, the seq-mean aggregations) do the same tensor arithmetic on",
        "both sides (k1 is `logp - ref` in both): their ratio is run-to-run noise on this shared",
        "machine (load above). verl's outputs differ from megarl's only by fp32 summation order.",
    ]
    if VERL_MISSING:
        lines += ["", VERL_MISSING]
    (results / "algos.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(THREADS)
    if VERL_MISSING:
        print(VERL_MISSING)
    d = make_data()
    cases = (
        estimator_cases(d)
        + policy_loss_cases(d)
        + loss_fn_cases(d)
        + aggregation_cases(d)
        + kl_and_tis_cases(d)
    )
    print(f"{'function':44} {'megarl ms':>10} {'verl ms':>10} {'speedup':>8} {'max diff':>10}")
    rows = [run_case(c) for c in cases]
    write_results(rows)


if __name__ == "__main__":
    main()
