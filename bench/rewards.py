"""Reward scoring throughput: megarl serial vs the parallel RewardScorer vs verl, same inputs.

Generates N synthetic gsm8k and math responses with ground truths (seeded: about half correct,
several answer formats and LaTeX forms, some without an answer), scores them with
- megarl serial: ``megarl.rewards.compute_score`` in a loop in this process,
- megarl parallel: ``RewardScorer`` (forkserver pool, ``--workers`` workers; the first call,
  which starts the workers, is timed apart from a second, warm call),
- verl (when importable; run in the bench venv): ``verl.utils.reward_score.gsm8k``
  (strict), ``math_reward`` (string normalisation) and ``math_verify`` (its subprocess pool),
and reports samples/s and the agreement rate of each with megarl serial. Also times the code
sandbox (one trivial program, plain and bubblewrap modes).

    .bench-venv/bin/python bench/rewards.py            # writes bench/results/rewards.{json,md}

Timings on a shared CPU box are noisy; compare within one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from megarl.config.sections import RewardConfig
from megarl.rewards import RewardScorer, compute_score
from megarl.rewards.code_sandbox import bwrap_available, run_program

Samples = tuple[list[str], list[str], list[str]]  # (responses, ground truths, form labels)


GSM8K_FORMS = (
    "#### n",
    "#### 1,234",
    "#### $n",
    "#### n.00",
    "unmarked",
    "wrong",
    "wrong",
    "wrong",
)
MATH_FORMS = (
    "percent",
    "interval",
    "radical",
    "no box",
    "two boxes",
    "number",
    "number",
    "number",
    "number",
    "number",
)


def gsm8k_samples(n: int, rng: random.Random) -> Samples:
    responses, truths, forms = [], [], []
    for _ in range(n):
        truth = rng.choice([rng.randint(0, 99), rng.randint(100, 99_999)])
        wrong = truth + rng.choice([-10, -1, 1, 2, 100])
        a = rng.randint(0, truth) if truth else 0
        steps = f"First, {a} + {truth - a} = {truth}. "
        form = rng.randrange(8)
        if form == 0:
            text = f"{steps}\n#### {truth}"
        elif form == 1:
            text = f"{steps}\n#### {truth:,}"
        elif form == 2:
            text = f"{steps}\n#### ${truth}"
        elif form == 3:
            text = f"{steps}\n#### {truth}.00"
        elif form == 4:
            text = f"{steps}So the answer is {truth}."  # no marker: strict scores 0
        else:
            text = f"{steps}\n#### {wrong}"
        responses.append(text)
        truths.append(str(truth))
        forms.append(GSM8K_FORMS[form])
    return responses, truths, forms


def _latex_forms(value: Fraction, rng: random.Random) -> str:
    """One of several ways to write ``value``."""
    num, den = value.numerator, value.denominator
    if den == 1:
        return rng.choice([str(num), f"{num}.0", f"\\frac{{{2 * num}}}{{2}}"])
    forms = [f"\\frac{{{num}}}{{{den}}}", f"\\dfrac{{{num}}}{{{den}}}", f"{num}/{den}"]
    if 10**6 % den == 0:  # terminating decimal
        forms.append(str(float(value)))
    return rng.choice(forms)


def math_samples(n: int, rng: random.Random) -> Samples:
    responses, truths, forms = [], [], []
    for _ in range(n):
        kind = rng.randrange(10)
        value = Fraction(rng.randint(-20, 60), rng.choice([1, 1, 2, 3, 4, 5, 8, 10]))
        truth = _latex_forms(value, rng)
        correct = rng.random() < 0.5
        shown = value if correct else value + rng.choice([1, -1, Fraction(1, 2)])
        answer = _latex_forms(shown, rng)
        if kind == 0:  # percent in the ground truth
            pct = rng.randint(1, 99)
            truth, answer = f"{pct}\\%", str(pct / 100 if correct else (pct + 1) / 100)
        elif kind == 1:  # interval
            lo, hi = sorted(rng.sample(range(-9, 10), 2))
            truth = f"[{lo},{hi})"
            answer = f"[{lo}, {hi})" if correct else f"({lo},{hi}]"
        elif kind == 2:  # radicals
            truth = "\\frac{\\sqrt{2}}{2}"
            answer = "\\frac{1}{\\sqrt{2}}" if correct else "\\sqrt{2}"
        prefix = "Let us compute step by step. The sum is $3 + 4 = 7$. "
        if kind == 3:
            text = f"{prefix}The answer is {answer}."  # no box: scores 0
        elif kind == 4:
            text = f"{prefix}First guess $\\boxed{{0}}$, but on reflection $\\boxed{{{answer}}}$."
        else:
            text = f"{prefix}Therefore the answer is $\\boxed{{{answer}}}$."
        responses.append(text)
        truths.append(truth)
        forms.append(MATH_FORMS[kind])
    return responses, truths, forms


def timed(fn: Callable[[], list[float]]) -> tuple[list[float], float]:
    start = time.perf_counter()
    scores = fn()
    return scores, time.perf_counter() - start


def agreement(a: list[float], b: list[float]) -> float:
    return sum(1 for x, y in zip(a, b, strict=True) if abs(x - y) < 1e-9) / len(a)


def disagreements(mine: list[float], theirs: list[float], forms: list[str]) -> dict[str, str]:
    """Per answer form: how many samples differ, and who scored them 1."""
    out: dict[str, list[int]] = {}
    for x, y, form in zip(mine, theirs, forms, strict=True):
        if abs(x - y) > 1e-9:
            counts = out.setdefault(form, [0, 0])
            counts[0 if x > y else 1] += 1
    return {form: f"{a + b} (megarl 1: {a}, other 1: {b})" for form, (a, b) in sorted(out.items())}


def verl_scorers() -> dict[str, dict[str, Callable[[str, str], float]]] | str:
    try:
        from verl.utils.reward_score import gsm8k as verl_gsm8k
        from verl.utils.reward_score import math_reward as verl_math
        from verl.utils.reward_score import math_verify as verl_math_verify
    except Exception as exc:  # noqa: BLE001 - verl lives only in the bench venv
        return f"verl not importable ({type(exc).__name__}: {exc}); run with .bench-venv/bin/python"
    return {
        "gsm8k": {"verl gsm8k (strict)": lambda s, g: float(verl_gsm8k.compute_score(s, g))},
        "math": {
            "verl math_reward": lambda s, g: float(verl_math.compute_score(s, g)),
            "verl math_verify": lambda s, g: float(verl_math_verify.compute_score(s, g)),
        },
    }


def bench_task(task: str, data: Samples, scorer: RewardScorer, verl: dict | str) -> list[dict]:
    responses, truths, forms = data
    n = len(responses)
    sources = [task] * n
    rows = []
    serial, secs = timed(
        lambda: [float(compute_score(task, r, g)) for r, g in zip(responses, truths, strict=True)]
    )
    rows.append(
        {"task": task, "scorer": "megarl serial", "seconds": secs, "mean_score": sum(serial) / n}
    )
    for label in ("megarl parallel (first call)", "megarl parallel (warm)"):
        result, secs = timed(lambda: scorer.score(sources, responses, truths).scores)
        rows.append({"task": task, "scorer": label, "seconds": secs, "mean_score": sum(result) / n})
        rows[-1]["agreement_with_megarl_serial"] = agreement(result, serial)
    if isinstance(verl, dict):
        for label, fn in verl[task].items():
            scores, secs = timed(
                lambda fn=fn: [fn(r, g) for r, g in zip(responses, truths, strict=True)]
            )
            rows.append(
                {"task": task, "scorer": label, "seconds": secs, "mean_score": sum(scores) / n}
            )
            rows[-1]["agreement_with_megarl_serial"] = agreement(scores, serial)
            rows[-1]["disagreements_by_form"] = disagreements(serial, scores, forms)
    for row in rows:
        row["samples"] = n
        row["samples_per_s"] = n / row["seconds"]
    return rows


def bench_sandbox(runs: int) -> list[dict]:
    rows = []
    for mode in [False, True] if bwrap_available() else [False]:
        start = time.perf_counter()
        ok = sum(
            run_program("print(int(input()) * 2)", "21\n", use_bwrap=mode).stdout == "42\n"
            for _ in range(runs)
        )
        secs = time.perf_counter() - start
        rows.append(
            {
                "sandbox": "bwrap" if mode else "plain",
                "runs": runs,
                "ok": ok,
                "runs_per_s": runs / secs,
            }
        )
    return rows


def machine() -> dict:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "math_verify": version("math-verify"),
        "pebble": version("pebble"),
        "verl": version("verl"),
        "bwrap": bwrap_available(),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
    }


def write_markdown(path: Path, report: dict) -> None:
    lines = [
        "# Reward scoring throughput",
        "",
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, torch {report['machine']['torch']}, "
        f"verl {report['machine']['verl']}, math-verify {report['machine']['math_verify']}; {report['machine']['date_utc']} UTC. "
        f"Parallel = RewardScorer with {report['workers']} workers. {report['note']}",
        "",
        "| task | scorer | samples | seconds | samples/s | mean score | agreement with megarl serial |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["scoring"]:
        agree = r.get("agreement_with_megarl_serial")
        lines.append(
            f"| {r['task']} | {r['scorer']} | {r['samples']} | {r['seconds']:.2f} | {r['samples_per_s']:.0f} | "
            f"{r['mean_score']:.3f} | {'-' if agree is None else f'{agree:.4f}'} |"
        )
    lines += [
        "",
        "Where verl and megarl disagree (samples per answer form of the synthetic set):",
        "",
    ]
    for r in report["scoring"]:
        for form, what in r.get("disagreements_by_form", {}).items():
            lines.append(f"- {r['task']}, {r['scorer']}, {form}: {what}")
    lines += ["", "| code sandbox | runs | correct | runs/s |", "|---|---|---|---|"]
    lines += [
        f"| {r['sandbox']} | {r['runs']} | {r['ok']} | {r['runs_per_s']:.1f} |"
        for r in report["sandbox"]
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sandbox-runs", type=int, default=50)
    parser.add_argument("--out", default="bench/results/rewards")
    args = parser.parse_args()
    rng = random.Random(0)
    data = {"gsm8k": gsm8k_samples(args.samples, rng), "math": math_samples(args.samples, rng)}
    verl = verl_scorers()
    note = (
        "verl: same process, same inputs."
        if isinstance(verl, dict)
        else f"verl side skipped: {verl}."
    )
    print(note)
    rows: list[dict] = []
    with RewardScorer(RewardConfig(workers=args.workers, timeout_s=10.0)) as scorer:
        for task, samples in data.items():
            rows += bench_task(task, samples, scorer, verl)
            for r in rows[-(len(rows) - sum(1 for x in rows if x["task"] != task)) :]:
                agree = r.get("agreement_with_megarl_serial")
                print(
                    f"{task:6s} {r['scorer']:30s} {r['samples_per_s']:9.0f} samples/s  mean {r['mean_score']:.3f}  agree {agree if agree is None else round(agree, 4)}"
                )
    sandbox = bench_sandbox(args.sandbox_runs)
    for r in sandbox:
        print(
            f"sandbox {r['sandbox']:5s} {r['runs_per_s']:.1f} runs/s ({r['ok']}/{r['runs']} correct)"
        )
    report = {
        "machine": machine(),
        "workers": args.workers,
        "note": note,
        "scoring": rows,
        "sandbox": sandbox,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(out.with_suffix(".md"), report)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
