"""`megarl evaluate --data GENERATED.parquet [CONFIG] [reward.KEY=VALUE ...]`: score every
response of a generated file with the reward functions and report, per data source, the mean
reward, pass@k, best@k / worst@k, maj@k, response lengths and the truncated share.

The numbers come from megarl/evaluation.py, the code RL validation logs ``val/*`` with; the
scores from the reward worker pool training uses (data_source routing, reward.custom, reward
models, timeouts and failure counting: megarl/rewards/scorer.py), or with reward.combine from its
components and the LLM judge as training combines them (megarl/rollout/reward_combine.py). Reward settings come from the
config's ``reward`` section, or without a config from ``reward.*`` overrides on the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megarl.commands.arguments import add_config_args, user_path
from megarl.commands.outputs import make_folder
from megarl.config.sections import BUILD_TIMEOUT_S
from megarl.disk_full import writing
from megarl.kept_files import write_atomically

log = logging.getLogger(__name__)
SCORE_CHUNK = 1024  # responses per scoring call (the reward pool reports each sample as it is scored)
SUMMARY_SUFFIX = ".eval.json"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="score generated responses offline: pass@k, maj@k, mean reward per data source",
        description="Scores every response in --data (what `megarl generate` writes) with the reward functions "
        "(the config's reward section, or reward.* overrides on the defaults) in the reward worker pool, prints a "
        "table per data source and writes a JSON summary: mean reward (mean@n), unbiased pass@k, best@k / worst@k, "
        "maj@k (when the reward function returns a 'pred'), response lengths and the share cut by max_new_tokens. "
        "RL validation logs the same numbers as val/*.",
    )
    p.add_argument("--data", type=user_path, required=True, help="parquet with a 'responses' list column (from megarl generate)")
    add_config_args(p, optional=True)
    p.add_argument("--k", default=None, help="comma-separated k of pass@k, best@k and maj@k, each <= the responses "
                   "per prompt (default: 1, 2, 4, ... up to n)")  # fmt: skip
    p.add_argument("--pass-threshold", type=float, default=None,
                   help="a response passes when its score is at least this, in (0, 1] for the built-in reward "
                   "functions (default: rollout.val.pass_threshold of the config, 1.0); for a reward function that "
                   "returns 'acc', that decides instead")  # fmt: skip
    p.add_argument("--out", type=user_path, default=None, help=f"JSON summary (default: DATA with {SUMMARY_SUFFIX} in place of .parquet)")
    p.add_argument("--scored", type=user_path, default=None, help="also write DATA's rows plus a 'scores' list column to this parquet "
                   "(replacing a 'scores' column DATA already has)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing --out / --scored files (a summary evaluate wrote is replaced anyway); "
                        "their folders are made when missing")  # fmt: skip
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # only overrides were given
        config, overrides = None, [config, *overrides]
    ks = _parse_ks(args.k)
    out = Path(args.out) if args.out else _default_out(Path(args.data))
    _check_outputs(Path(args.data), out, Path(args.scored) if args.scored else None, args.overwrite)
    from megarl.rewards.pool_helpers import resource_tracker_pids
    from megarl.tagged_processes import ending_what_it_starts
    from megarl.trainer.run_lock import output_lock
    from megarl.trainer.watchdog import run_stoppable

    with ExitStack() as held:  # one evaluate writes each output: a second one is refused, naming this one
        for flag, path in (("--out", out), ("--scored", args.scored)):
            if path is not None:
                held.enter_context(output_lock(path, flag))
        # a reward function's own children end with the command; the resource tracker unlinks the
        # pool's semaphores when this process exits
        held.enter_context(ending_what_it_starts(spare=resource_tracker_pids))
        # nothing written yet: --scored is renamed into place only when whole
        summary = run_stoppable(lambda: evaluate(args.data, config, overrides, ks=ks, pass_threshold=args.pass_threshold,
                                                 scored=args.scored, reward_log=reward_log(out),
                                                 judge_log=judge_log(out)),
                                "while scoring; nothing was written; run the same command again")  # fmt: skip
        make_folder(out)
        with writing(out, "the summary (--out)", kept=f"{args.scored or 'no scored rows'}; an earlier summary is as it was"):
            write_atomically(out, json.dumps(summary, indent=2) + "\n")  # a kill leaves the old summary or the new
    print(format_table(summary))
    print(f"wrote {out}" + (f" and {args.scored}" if args.scored else ""))
    return 0


def _check_outputs(data: Path, summary: Path, scored: Path | None, overwrite: bool) -> None:
    """Neither output may be the input, nor inside a run's checkpoints folder; an existing file is
    replaced only when it is a summary evaluate wrote (the JSON), or with --overwrite. Their
    folders are checked now and made when written (a refusal in between leaves none)."""
    from megarl.commands.outputs import (
        check_folder,
        check_new_file,
        check_outside_checkpoints,
        same_file,
    )
    from megarl.evaluation import EvaluationError

    if scored is not None and same_file(scored, summary):
        raise EvaluationError(f"--scored {scored} is also the --out summary; give two different paths")
    outputs = [(flag, path) for flag, path in (("--out", summary), ("--scored", scored)) if path is not None]
    for flag, path in outputs:
        if same_file(path, data):
            raise EvaluationError(f"{flag} {path} is the --data file; give another path")
        # checked before scoring, which can take long: a wrong folder must not cost the whole run
        check_outside_checkpoints(path, flag=flag)
        check_new_file(path, overwrite or (flag == "--out" and _is_summary(path)), flag=flag)
        check_folder(path, flag=flag)  # made when written: a later refusal leaves no empty folder


def _is_summary(path: Path) -> bool:
    try:
        return "per_data_source" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _parse_ks(text: str | None) -> list[int] | None:
    from megarl.evaluation import EvaluationError

    if text is None:
        return None
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise EvaluationError(f"--k {text!r}: expected comma-separated whole numbers such as 1,8") from None
    if not ks:  # an empty list would silently report no pass@k / best@k / maj@k at all
        raise EvaluationError(f"--k {text!r} names no k; give comma-separated whole numbers such as 1,8, or leave "
                              "--k out for 1, 2, 4, ... up to n")  # fmt: skip
    return ks


def _default_out(data: Path) -> Path:
    return data.with_name(data.name.removesuffix(".parquet") + SUMMARY_SUFFIX)


def reward_log(summary: Path) -> Path:
    """Where the reward functions' stdout and stderr go: beside the --out summary (removed when empty)."""
    return summary.with_name(summary.name.removesuffix(".json") + ".reward_workers.log")


def judge_log(summary: Path) -> Path:
    """Where reward.judge's SGLang server writes its log: beside the --out summary."""
    return summary.with_name(summary.name.removesuffix(".json") + ".judge_sglang.log")


def evaluate(data: str | Path, config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
             ks: list[int] | None = None, pass_threshold: float | None = None, scored: str | Path | None = None,
             reward_log: str | Path | None = None, judge_log: str | Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Score ``data`` and summarise it (the JSON ``megarl evaluate`` writes); the reward functions'
    output goes to ``reward_log`` (None: this process's stdout and stderr), reward.judge's SGLang
    server's to ``judge_log`` (None: a temporary folder, removed when the scoring ends)."""
    from megarl.config.loading import load_config, load_section
    from megarl.data.generated import read_generated
    from megarl.evaluation import (
        EvaluationError,
        add_components,
        check_ks,
        ragged_note,
        scored_responses,
        summarize,
        threshold_problem,
    )
    from megarl.rewards.combine import component_scores
    from megarl.rollout_sglang.cpu_venv import with_cpu_server_python

    if config is not None:
        cfg = with_cpu_server_python(load_config(config, overrides))  # a judge's SGLang on CPU: as `megarl demo` finds it
        reward, prompt_key, threshold = cfg.reward, cfg.data.prompt_key, cfg.rollout.val.pass_threshold
        judge_runs = JudgeRuns(cfg.rollout.server_python, cfg.cluster.build_timeout_s, judge_log)
    else:
        reward, prompt_key, threshold = load_section(overrides, "reward"), "prompt", 1.0
        judge_runs = JudgeRuns(log_path=judge_log)
    name = "rollout.val.pass_threshold" if pass_threshold is None else "--pass-threshold"
    pass_threshold = threshold if pass_threshold is None else pass_threshold
    problem = threshold_problem(pass_threshold, reward)
    if problem:
        raise EvaluationError(f"{name} {problem}")
    rows = read_generated(data, prompt_key=prompt_key)
    flat = [(r, j) for r, answers in enumerate(rows.responses) for j in range(len(answers))]
    counts = [len(answers) for answers in rows.responses if answers]
    if ks is not None and counts:  # before the scoring, which can take long: summarize checks the same
        check_ks(ks, max(counts))
    if note := ragged_note(counts, ks):  # said before the scoring, which can take long
        log.warning("--data %s: %s", data, note)
    problem = _reward_problem(reward)
    if problem:
        raise EvaluationError(problem)
    _check_scorable(reward, rows.records, data)
    try:
        result = _score(reward, rows, flat, judge_runs, reward_log)
    except ValueError as exc:  # reward.custom that does not load, a data_source without a scorer
        raise EvaluationError(str(exc)) from exc
    lengths = [rows.lengths[r][j] for r, j in flat] if rows.lengths is not None else [-1] * len(flat)
    reasons = [rows.finish_reasons[r][j] for r, j in flat] if rows.finish_reasons is not None else [""] * len(flat)
    responses = scored_responses([rows.records[r].data_source for r, _ in flat], [r for r, _ in flat], result.scores,
                                 lengths, reasons, pass_threshold=pass_threshold, acc=result.extra.get("acc"),
                                 preds=result.preds)  # fmt: skip
    summary = summarize(responses, ks)
    add_components(summary, [rows.records[r].data_source for r, _ in flat], component_scores(reward, result.extra))
    if rows.lengths is None or rows.finish_reasons is None:  # not known: not reported
        for values in summary.values():
            for name in [n for n in values if n.startswith("response_length/") or n == "truncated_frac"]:
                del values[name]
    if scored is not None:
        _write_scored(data, scored, rows.responses, result.scores)
    return {
        "data": str(data),
        "pass_threshold": pass_threshold,
        "reward": {"errors": result.errors, "worker_deaths": result.deaths, "timeouts": result.timeouts, **result.judge_counts},
        "per_data_source": {source: _finite(values) for source, values in summary.items()},
    }


def _reward_problem(reward: Any) -> str | None:
    """reward.custom, reward.model, reward.combine and reward.judge checked as a launch checks them,
    before the workers start: a file that hangs at import is refused in bounded time, a model
    directory the workers would refuse from its config.json alone (not on every sample, after each
    worker loaded it), a component that names nothing, a judge's directory or template."""
    from megarl.plan.reward_checks import judge_problem
    from megarl.rewards.combine import component_problems

    problems: list[str | None] = list(component_problems(reward))  # (each names reward.combine[...])
    problems += [judge_problem(reward.judge)] if reward.judge is not None else []
    if any(problems):
        return next(p for p in problems if p)
    if reward.custom is not None:
        from megarl.plan.import_check_child import reward_file_problem

        return reward_file_problem(reward.custom)
    if reward.model is not None:
        from megarl.rewards.reward_model import model_dir_problem

        problem = model_dir_problem(reward.model.path)
        return f"reward.model.path: {problem}" if problem else None
    return None


def _check_scorable(reward: Any, records: list[Any], data: str | Path) -> None:
    """What a launch's pre-flight refuses in its files, refused here before any scoring: a
    data_source no scorer takes, a ground truth (null, blank) a built-in scorer would score 0."""
    from megarl.data.datasets import file_label
    from megarl.evaluation import EvaluationError
    from megarl.plan.preflight import scorer_findings

    findings = scorer_findings(reward, [(file_label("--data", data), records)])
    if findings:
        raise EvaluationError(f"{findings[0].field}: {findings[0].message}")


@dataclass(frozen=True)
class JudgeRuns:
    """How reward.judge's engine starts here (a config's rollout.server_python and
    cluster.build_timeout_s; without a config, this interpreter and the default deadline)."""

    server_python: str | None = None
    start_timeout_s: float = BUILD_TIMEOUT_S
    log_path: str | Path | None = None  # the SGLang server's log (None: in a temporary folder)


@dataclass
class Scored:
    """Every response's score, pred and extras (reward.combine's components among them), the failures."""

    scores: list[float] = field(default_factory=list)
    preds: list[Any] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    deaths: int = 0  # of the errors, samples whose worker died (os._exit, a crash, a kill)
    timeouts: int = 0
    judge_counts: dict[str, int] = field(default_factory=dict)  # judge_errors, judge_timeouts: with reward.judge


def _scorer(reward: Any, judge_runs: JudgeRuns, stops: str, log_path: str | Path | None) -> Any:
    """The reward pool, or with reward.combine the pools and the judge that score its components
    (the judge's engine in this process, or its SGLang server a child of it); the reward functions'
    output goes to ``log_path``."""
    from megarl.rewards.scorer import RewardScorer

    if not reward.combine:
        return RewardScorer(reward, stops=stops, log_path=log_path)
    from megarl.rollout.judge import start_judge
    from megarl.rollout.reward_combine import CombinedScorer

    judge = None if reward.judge is None else start_judge(
        reward.judge, in_process=True, log_dir=".", start_timeout_s=judge_runs.start_timeout_s,
        max_failed_fraction=reward.max_failed_fraction, stops=stops, server_python=judge_runs.server_python,
        server_log=judge_runs.log_path)  # fmt: skip
    try:
        return CombinedScorer(reward, judge, stops=stops, log_path=log_path)
    except BaseException:
        if judge is not None:
            judge.close()
        raise


def _score(reward: Any, rows: Any, flat: list[tuple[int, int]], judge_runs: JudgeRuns, log_path: str | Path | None) -> Scored:
    """Every response scored in the reward pool (and reward.combine's judge), in chunks (one progress tick each)."""
    from megarl.progress import counting
    from megarl.rewards.scorer import RewardScorer

    total = Scored()
    scratch = None
    if judge_runs.log_path is None:  # an API call that names no judge log: one that does not outlive the scoring
        scratch = tempfile.TemporaryDirectory(prefix="megarl-evaluate-judge-")
        judge_runs = replace(judge_runs, log_path=Path(scratch.name) / "judge_sglang.log")
    try:
        scorer = _scorer(reward, judge_runs, "evaluate stops rather than report them as scores of 0", log_path)
    except BaseException:
        if scratch is not None:
            scratch.cleanup()
        raise
    try:
        with counting(len(flat), "scoring", "responses") as advance:
            for start in range(0, len(flat), SCORE_CHUNK):
                chunk = flat[start : start + SCORE_CHUNK]
                records = [rows.records[r] for r, _ in chunk]
                prompts = [rows.prompt_text[r] if rows.prompt_text else str(rows.records[r].prompt) for r, _ in chunk]
                told = _Told(advance)
                # the reward pool tells each sample scored (the bar moves within a chunk, no second
                # progress line of its own); reward.combine's scorer moves it chunk by chunk
                progress = {"on_scored": told} if isinstance(scorer, RewardScorer) else {}
                part = scorer.score([x.data_source for x in records], [rows.responses[r][j] for r, j in chunk],
                                    [x.ground_truth for x in records], [x.extra_info for x in records], prompts=prompts,
                                    raw_prompts=[x.prompt for x in records], **progress)  # fmt: skip
                _add_part(total, part, len(chunk))
                advance(len(chunk) - told.count)
    finally:
        scorer.close()
        if scratch is not None:
            scratch.cleanup()
    return total


class _Told:
    """``advance`` of the progress display, counting what it was told."""

    def __init__(self, advance: Callable[[int], None]) -> None:
        self.advance, self.count = advance, 0

    def __call__(self, n: int) -> None:
        self.count += n
        self.advance(n)


def _add_part(total: Scored, part: Any, n: int) -> None:
    """One chunk's ScoreResult (a CombinedResult with reward.combine) appended to ``total``."""
    for key in set(total.extra) | set(part.extra):  # NaN where a chunk had no such value
        total.extra.setdefault(key, [math.nan] * len(total.scores)).extend(part.extra.get(key, [math.nan] * n))
    total.scores += part.scores
    total.preds += part.preds
    total.errors, total.timeouts = total.errors + part.errors, total.timeouts + part.timeouts
    total.deaths += getattr(part, "deaths", 0)  # (reward.combine's result counts none apart)
    if getattr(part, "judged", False):
        total.judge_counts["judge_errors"] = total.judge_counts.get("judge_errors", 0) + part.judge_errors
        total.judge_counts["judge_timeouts"] = total.judge_counts.get("judge_timeouts", 0) + part.judge_timeouts


def _write_scored(data: str | Path, out: str | Path, responses: list[list[str]], scores: list[float]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.data.generated import SCORES

    per_row, start = [], 0
    for answers in responses:
        per_row.append(scores[start : start + len(answers)])
        start += len(answers)
    table = pq.read_table(data)
    column = pa.array(per_row, type=pa.list_(pa.float64()))
    if SCORES in table.column_names:  # a file scored before: the new scores replace the old, in place
        table = table.set_column(table.column_names.index(SCORES), SCORES, column)
    else:
        table = table.append_column(SCORES, column)
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    make_folder(Path(out), flag="--scored")
    try:
        with writing(out, "the scored rows (--scored)", kept="nothing of this evaluation; the files you had are as they were"):
            pq.write_table(table, tmp)
            tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left beside OUT
        raise


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN: None instead."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}


def format_table(summary: dict[str, Any]) -> str:
    """The console table: one row per data source (``all`` first), one column per number."""
    per_source = summary["per_data_source"]
    # worst@k is in the JSON only: the table stays readable
    columns = [n for n in dict.fromkeys(n for values in per_source.values() for n in values) if not n.startswith("worst@")]
    header = ["data_source", *(_short_name(c) for c in columns)]
    body = [[source, *(_cell(values.get(c)) for c in columns)] for source, values in per_source.items()]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *body]]  # fmt: skip
    failed = summary["reward"]
    if failed["errors"] or failed["timeouts"]:
        from megarl.rewards.scorer import WORKER_DIED

        deaths = failed.get("worker_deaths", 0)
        died = f", {WORKER_DIED} on {deaths}" if deaths else ""  # the scorer's words for those samples
        lines.append(f"reward functions raised on {failed['errors'] - deaths}{died} and timed out on {failed['timeouts']} "
                     "responses (scored 0)")
    return "\n".join(lines)


def _short_name(name: str) -> str:
    return {"reward/mean": "reward", "response_length/mean": "len_mean", "response_length/min": "len_min",
            "response_length/max": "len_max", "truncated_frac": "truncated"}.get(name, name)  # fmt: skip


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 1 else f"{value:.3f}"
