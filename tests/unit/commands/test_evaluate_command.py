"""`megarl evaluate` on a small hand-written generated file: re-scoring a scored file, an empty
--k list, the pass threshold, output paths (their folders made) and the reward file checked
before any response is scored (the scoring itself runs in tests/e2e/test_generate_evaluate.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.cli import EXIT_USER, main
from megarl.commands.evaluate import evaluate
from megarl.evaluation import EvaluationError
from megarl.plan import import_check_child

# A reward function that leaves a trace: whether scoring started at all (it runs in the workers).
TRACING_REWARD = """
from pathlib import Path

def score(data_source, solution_str, ground_truth, extra_info=None):
    Path(__file__).with_name("scored.flag").write_text("called")
    return float(solution_str == ground_truth)
"""


@pytest.fixture
def generated(tmp_path):
    """Two prompts of the demo's task with two responses each, as `megarl generate` writes them."""
    rows = {"data_source": ["reverse_digits"] * 2, "prompt": ["123", "456"],
            "reward_model": [{"ground_truth": "321", "style": "rule"}, {"ground_truth": "654", "style": "rule"}],
            "responses": [["321", "999"], ["654", "654"]]}  # fmt: skip
    pq.write_table(pa.table(rows), tmp_path / "gen.parquet")
    return tmp_path / "gen.parquet"


def test_scoring_a_scored_file_replaces_its_scores_column(generated, tmp_path):
    first, second = tmp_path / "sc.parquet", tmp_path / "sc2.parquet"
    assert main(["evaluate", "--data", str(generated), "--scored", str(first), "--out", str(tmp_path / "a.json")]) == 0
    assert main(["evaluate", "--data", str(first), "--scored", str(second), "--out", str(tmp_path / "b.json")]) == 0
    schema = pq.read_schema(second)
    # one 'scores' column, where it was: a second one made the file unreadable for evaluate itself
    assert schema.names == pq.read_schema(first).names == [*pq.read_schema(generated).names, "scores"]
    scores = pq.read_table(second).column("scores").to_pylist()
    assert scores == pq.read_table(first).column("scores").to_pylist() and [row[0] for row in scores] == [1.0, 1.0]
    assert main(["evaluate", "--data", str(second), "--out", str(tmp_path / "c.json")]) == 0


def test_an_empty_k_list_is_refused_in_one_line(generated, tmp_path, capsys):
    for text in (",", ""):
        assert main(["evaluate", "--data", str(generated), "--k", text, "--out", str(tmp_path / "k.json")]) == EXIT_USER
        err = capsys.readouterr().err
        assert err.startswith(f"error: --k {text!r} names no k") and err.count("\n") == 1
    assert not (tmp_path / "k.json").exists()  # not a summary without any pass@k


def test_a_k_above_the_responses_is_refused_before_scoring(generated, tmp_path, capsys):
    (tmp_path / "reward.py").write_text(TRACING_REWARD)
    custom = [f"reward.custom.path={tmp_path / 'reward.py'}", "reward.custom.name=score"]
    for k in ("1,4", "0"):
        assert main(["evaluate", "--data", str(generated), *custom, "--k", k, "--out", str(tmp_path / "k.json")]) == EXIT_USER
        err = capsys.readouterr().err
        assert err.startswith(f"error: k {k[-1]} is not in 1..2: the prompt with the most responses has 2") and err.count("\n") == 1
    assert not (tmp_path / "scored.flag").exists() and not (tmp_path / "k.json").exists()  # nothing scored


@pytest.mark.parametrize("flag", ["--out", "--scored"])
def test_a_missing_output_folder_is_made_as_generate_makes_its_own(generated, tmp_path, flag):
    target = tmp_path / "new" / "deeper" / ("s.json" if flag == "--out" else "x.parquet")
    args = ["evaluate", "--data", str(generated), flag, str(target)]
    assert main([*args, "--out", str(tmp_path / "s.json")] if flag == "--scored" else args) == 0
    assert target.is_file() and target.stat().st_size > 0


def test_a_refused_evaluate_leaves_no_output_folder(tmp_path, capsys):
    target = tmp_path / "new" / "deeper" / "s.json"
    assert main(["evaluate", "--data", str(tmp_path / "missing.parquet"), "--out", str(target)]) == EXIT_USER
    assert "missing.parquet" in capsys.readouterr().err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("flag", ["--out", "--scored"])
def test_an_output_that_is_the_data_under_another_name_is_refused(generated, tmp_path, capsys, flag):
    (tmp_path / "link.parquet").symlink_to(generated)
    before = generated.read_bytes()
    for target in (tmp_path / "sub" / ".." / "gen.parquet", tmp_path / "link.parquet"):
        args = ["evaluate", "--data", str(generated), flag, str(target), "--overwrite"]
        assert main([*args, "--out", str(tmp_path / "s.json")] if flag == "--scored" else args) == EXIT_USER
        assert capsys.readouterr().err == f"error: {flag} {target} is the --data file; give another path\n"
    assert generated.read_bytes() == before and (tmp_path / "link.parquet").is_symlink()
    args = ["evaluate", "--data", str(generated), "--out", str(tmp_path / "s.json"), "--scored", str(tmp_path / "x" / ".." / "s.json")]
    assert main(args) == EXIT_USER and "is also the --out summary" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--scored"])
def test_an_output_folder_that_is_a_file_is_refused_before_scoring(generated, tmp_path, capsys, flag):
    (tmp_path / "reward.py").write_text(TRACING_REWARD)
    custom = [f"reward.custom.path={tmp_path / 'reward.py'}", "reward.custom.name=score"]
    (tmp_path / "notes").write_text("the user's")
    target = tmp_path / "notes" / "sub" / "x.parquet"
    args = ["evaluate", "--data", str(generated), *custom, flag, str(target)]
    assert main([*args, "--out", str(tmp_path / "s.json")] if flag == "--scored" else args) == EXIT_USER
    err = capsys.readouterr().err
    assert err == f"error: {flag} {target}: {tmp_path / 'notes'} is not a folder; give another path\n"
    assert not (tmp_path / "scored.flag").exists()  # refused before the reward functions ran
    assert (tmp_path / "notes").read_text() == "the user's"


@pytest.mark.parametrize("flag", ["--out", "--scored"])
def test_an_output_inside_a_runs_checkpoints_is_refused_before_scoring(generated, tmp_path, capsys, flag):
    from megarl.checkpoint.manager import CheckpointManager

    (tmp_path / "reward.py").write_text(TRACING_REWARD)
    custom = [f"reward.custom.path={tmp_path / 'reward.py'}", "reward.custom.name=score"]
    with CheckpointManager(tmp_path / "run").saving(4) as d:
        (d / "state").write_text("s")
    target = tmp_path / "run" / "checkpoints" / "step_000004" / "x.parquet"
    args = ["evaluate", "--data", str(generated), *custom, flag, str(target)]
    assert main([*args, "--out", str(tmp_path / "s.json")] if flag == "--scored" else args) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {target} is inside the checkpoints folder of a run") and err.count("\n") == 1
    assert not target.exists() and not (tmp_path / "scored.flag").exists()


@pytest.mark.parametrize(("threshold", "outcome"), [("2", "no response could pass"), ("-0.5", "every response would pass"),
                                                    ("0", "every response would pass")])  # fmt: skip
def test_a_pass_threshold_the_built_in_scores_cannot_meet_is_refused(generated, tmp_path, capsys, threshold, outcome):
    out = tmp_path / "s.json"
    assert main(["evaluate", "--data", str(generated), "--pass-threshold", threshold, "--out", str(out)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err == (f"error: --pass-threshold ({float(threshold):g}) must be in (0, 1]: the built-in reward functions "
                   f"score from 0 to 1, so {outcome}; e.g. 1 (a full score) or 0.5\n")
    assert not out.exists()


def test_a_custom_reward_takes_any_finite_pass_threshold(generated, tmp_path, capsys):
    import json

    (tmp_path / "reward.py").write_text(TRACING_REWARD)
    custom = [f"reward.custom.path={tmp_path / 'reward.py'}", "reward.custom.name=score"]
    out = tmp_path / "s.json"
    assert main(["evaluate", "--data", str(generated), *custom, "--pass-threshold", "2", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["pass_threshold"] == 2.0 and summary["per_data_source"]["all"]["pass@1"] == 0.0  # scores 0 or 1
    assert main(["evaluate", "--data", str(generated), *custom, "--pass-threshold", "nan", "--out", str(out)]) == EXIT_USER
    assert capsys.readouterr().err.startswith("error: --pass-threshold (nan) must be a finite number")


def test_a_reward_file_that_hangs_at_import_is_refused_in_bounded_time(tmp_path, monkeypatch):
    data = tmp_path / "gen.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["mine"], "reward_model": [{"ground_truth": "4"}],
                             "responses": [["4", "5"]]}), data)  # fmt: skip
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(10000)\n\ndef compute_score(**kwargs):\n    return 1.0\n")
    monkeypatch.setattr(import_check_child, "CHILD_TIMEOUT_S", 2.0)  # launch's bound, shortened for the test
    start = time.monotonic()
    with pytest.raises(EvaluationError, match=rf"^reward.custom: loading 'compute_score' from {hangs} failed: importing "
                                              rf"reward.custom from {hangs} did not finish within 2 s: check it"):  # fmt: skip
        evaluate(data, overrides=[f"reward.custom.path={hangs}"])
    assert time.monotonic() - start < 30
    hangs.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return float(solution_str == ground_truth)\n")  # fmt: skip
    summary = evaluate(data, overrides=[f"reward.custom.path={hangs}"])  # a file that loads is scored
    assert summary["per_data_source"]["all"]["reward/mean"] == 0.5


def test_a_float_ground_truth_column_scores_as_the_answer_text_data_convert_writes(tmp_path):
    """A parquet file the user wrote with a float64 ground truth: the math scorer compares the
    responses with "0.00001", as with a converted file, not with str's "1e-05"."""
    data, scored = tmp_path / "floats.parquet", tmp_path / "scored.parquet"
    rows = {"data_source": ["math", "math"], "prompt": ["a tenth of 0.0001?", "half of 5?"],
            "reward_model": [{"ground_truth": 1e-05, "style": "rule"}, {"ground_truth": 2.5, "style": "rule"}],
            "responses": [["$\\boxed{0.00001}$", "$\\boxed{0.0001}$"], ["$\\boxed{2.5}$", "$\\boxed{2}$"]]}  # fmt: skip
    pq.write_table(pa.table(rows), data)
    assert pq.read_schema(data).field("reward_model").type.field("ground_truth").type == pa.float64()
    assert main(["evaluate", "--data", str(data), "--scored", str(scored), "--out", str(tmp_path / "s.json")]) == 0
    assert pq.read_table(scored).column("scores").to_pylist() == [[1.0, 0.0], [1.0, 0.0]]


@pytest.mark.parametrize("truth", [None, " ", float("nan")])
def test_a_ground_truth_no_built_in_scorer_can_compare_is_refused_before_scoring(tmp_path, capsys, truth):
    """As a launch's pre-flight refuses it: every response of the row would score 0, silently."""
    data = tmp_path / "gen.parquet"
    rows = {"data_source": ["openai/gsm8k"] * 2, "prompt": ["2+2?", "3+3?"],
            "reward_model": [{"ground_truth": 4.0 if isinstance(truth, float) else "4", "style": "rule"},
                             {"ground_truth": truth, "style": "rule"}],  # NaN: how pandas writes a missing float
            "responses": [["#### 4", "#### 5"], ["#### 6", "#### 7"]]}  # fmt: skip
    pq.write_table(pa.table(rows), data)
    assert main(["evaluate", "--data", str(data), "--out", str(tmp_path / "s.json")]) == EXIT_USER
    assert capsys.readouterr().err == (f"error: --data (gen.parquet): row 1: reward_model.ground_truth is {truth!r}; the "
                                       "built-in scorer 'gsm8k' compares each response with it: give the answer, or "
                                       "score with reward.custom\n")  # fmt: skip
    assert not (tmp_path / "s.json").exists()
    (tmp_path / "reward.py").write_text(TRACING_REWARD)  # a function of the user's may take it
    custom = [f"reward.custom.path={tmp_path / 'reward.py'}", "reward.custom.name=score"]
    assert evaluate(data, overrides=custom)["per_data_source"]["all"]["responses"] == 4


SLOW_REWARD = """
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from pathlib import Path

def score(data_source, solution_str, ground_truth, extra_info=None):
    Path(__file__).with_name("started.flag").write_text("scoring")
    time.sleep(60)
    return 1.0
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGALRM], ids=["sigterm", "sigalrm"])
def test_a_stop_signal_while_scoring_stops_with_one_line_and_its_exit_code(generated, tmp_path, signum):
    # Python's default SIGTERM (or SIGALRM: any signal whose default ends the process) would end it
    # mid-scoring: no line, the pool's semaphores leaked, an exit code that names nothing.
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    args = [sys.executable, "-m", "megarl.cli", "evaluate", "--data", str(generated), "--scored", str(tmp_path / "sc.parquet"),
            f"reward.custom.path={tmp_path / 'slow.py'}", "reward.custom.name=score", "reward.timeout_s=120"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}  # this tree's megarl
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started.flag").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]  # 143, 142
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == f"stopped by {name} while scoring; nothing was written; run the same command again"
    assert "error:" not in err and "Traceback" not in err, err[-3000:]
    assert not list(tmp_path.glob("sc.parquet*")) and not list(tmp_path.glob("*.eval.json"))


FORKING_REWARD = """
import os
import time

def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.fork() == 0:  # a child of the user's that outlives its worker, re-parented
        time.sleep(300)
        os._exit(0)
    return 0.5
"""


def _carrying(entry: bytes) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone meanwhile, or a zombie
            pass
    return found


def test_what_a_reward_function_starts_ends_with_the_command(generated, tmp_path):
    # Without the sweep, every worker's forked child, the forkserver and the resource tracker were
    # still running long after evaluate's rc 0.
    (tmp_path / "forking.py").write_text(FORKING_REWARD)
    mark = f"MEGARL_TEST_MARK={os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), mark.split("=")[0]: mark.split("=")[1]}
    done = subprocess.run([sys.executable, "-m", "megarl.cli", "evaluate", "--data", str(generated), "--out", str(tmp_path / "e.json"),
                           f"reward.custom.path={tmp_path / 'forking.py'}", "reward.custom.name=score"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    deadline = time.monotonic() + 60  # the resource tracker ends on its own once the command has
    while _carrying(mark.encode()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _carrying(mark.encode()) == []


@pytest.mark.parametrize("closed", [">&-", "2>&-"], ids=["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_ends_no_evaluate(generated, tmp_path, closed):
    # Python leaves a closed standard stream None: the reward pool's first flush of it ended the
    # command with a traceback and exit code 1 (a launch too, after Ray and its ranks had started).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    command = f'exec "$@" {closed}'
    done = subprocess.run(["sh", "-c", command, "sh", sys.executable, "-m", "megarl.cli", "evaluate", "--data", str(generated),
                           "--out", str(tmp_path / "e.json")], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per_data_source" in (tmp_path / "e.json").read_text()


def test_a_reward_file_that_signals_its_process_group_at_import_is_named_not_a_ctrl_c(generated, tmp_path):
    # The import check's child shared the command's process group: os.killpg(os.getpgrp(), SIGINT)
    # there reached the command, which said "interrupted (Ctrl-C)" with exit code 130.
    (tmp_path / "rude.py").write_text("import os, signal\nos.killpg(os.getpgrp(), signal.SIGINT)\n\n"
                                      "def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, "-m", "megarl.cli", "evaluate", "--data", str(generated), "--out", str(tmp_path / "e.json"),
                           f"reward.custom.path={tmp_path / 'rude.py'}", "reward.custom.name=f"], env=env, capture_output=True,
                          text=True, timeout=300, start_new_session=True)  # fmt: skip (its own group: a regression hits it alone)
    assert done.returncode == EXIT_USER, done.stderr[-3000:]
    assert done.stderr.startswith("error: reward.custom: loading 'f' from ") and done.stderr.count("\n") == 1, done.stderr
    assert "it raised KeyboardInterrupt at import (a SIGINT it sent to its own process or process group)" in done.stderr


def test_rows_with_different_numbers_of_responses_keep_pass_at_the_largest_k_and_say_so(tmp_path, caplog):
    rows = {"data_source": ["reverse_digits"] * 2, "prompt": ["123", "456"],
            "reward_model": [{"ground_truth": "321", "style": "rule"}, {"ground_truth": "654", "style": "rule"}],
            "responses": [["321", "999", "999", "999"], ["654", "654"]]}  # fmt: skip
    pq.write_table(pa.table(rows), tmp_path / "ragged.parquet")
    assert main(["evaluate", "--data", str(tmp_path / "ragged.parquet"), "--out", str(tmp_path / "r.json")]) == 0
    summary = json.loads((tmp_path / "r.json").read_text())["per_data_source"]["all"]
    assert summary["pass@4"] == pytest.approx(1.0) and summary["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    warning = [r for r in caplog.records if "2 to 4 responses" in r.getMessage()]
    assert len(warning) == 1 and "(k=4: 1 of the 2 rows)" in warning[0].getMessage() and warning[0].levelname == "WARNING"


def test_a_reward_function_that_calls_sys_exit_is_one_error_line_not_its_exit_code(generated, tmp_path, capsys):
    """It used to end evaluate with the function's exit code and no output at all."""
    (tmp_path / "reward.py").write_text("import sys\n\ndef compute_score(data_source, solution_str, ground_truth, "
                                        "extra_info=None):\n    print('leaving now')\n    sys.exit(3)\n")  # fmt: skip
    out = tmp_path / "e.json"
    assert main(["evaluate", "--data", str(generated), f"reward.custom.path={tmp_path / 'reward.py'}", "--out", str(out)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: reward.custom 'compute_score' (reward.py) called sys.exit(3) while scoring "
                          "data_source='reverse_digits'") and err.count("\n") == 1, err
    log = tmp_path / "e.reward_workers.log"  # the function's output: beside the summary, quoted in the line
    assert "leaving now" in log.read_text() and f"(the workers' output: {log}, there: 'leaving now" in err
    assert not out.exists()
def test_reward_combine_scores_the_weighted_sum_and_reports_each_component(generated, tmp_path):
    """Two rule components of one data source: the score is their weighted sum, each is reported as
    training logs it (reward/<component>, the mean over the responses that use it)."""
    summary = evaluate(generated, None, ["reward.workers=1", "reward.combine={reverse_digits: {reverse_digits: 1.0, gsm8k_flexible: 0.5}}"],
                       pass_threshold=1.0, scored=tmp_path / "scored.parquet")  # fmt: skip
    for source in ("all", "reverse_digits"):
        values = summary["per_data_source"][source]
        assert values["reward/gsm8k_flexible"] == 0.75  # 3 of the 4 responses hold the answer
        assert values["reward/reverse_digits"] < 1.0  # '999' is not '321'
        assert values["reward/mean"] == pytest.approx(values["reward/reverse_digits"] + 0.5 * values["reward/gsm8k_flexible"])
    scores = pq.read_table(tmp_path / "scored.parquet").column("scores").to_pylist()
    assert scores[1] == [1.5, 1.5]  # both components full: 1.0 + 0.5
    assert summary["reward"] == {"errors": 0, "worker_deaths": 0, "timeouts": 0}  # no judge: no judge counts


def test_reward_combine_naming_no_scorer_is_refused_before_scoring(generated, tmp_path):
    with pytest.raises(EvaluationError, match=r"reward.combine\['reverse_digits'\] names the component 'gsm9k'.*use one of"):
        evaluate(generated, None, ["reward.combine={reverse_digits: {gsm9k: 1.0}}"])


def test_the_sglang_judges_server_log_lies_beside_out_and_no_temporary_folder_is_left(generated, tmp_path, capsys, monkeypatch):
    """The judge's server log goes beside --out (as the reward workers' log does), not into a
    temporary folder that nothing removes. No SGLang here: the server fails to start, and its log says why."""
    import tempfile

    from megarl.commands.demo import prepare_demo

    model, _ = prepare_demo(tmp_path / "demo")
    private = tmp_path / "tmp"  # this test's own: another test's evaluate (under -n) may make and remove one meanwhile
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    before = set(Path(tempfile.gettempdir()).glob("megarl-evaluate-judge-*"))
    out = tmp_path / "out" / "summary.json"
    code = main(["evaluate", "--data", str(generated), "--out", str(out), "reward.workers=1",
                 "reward.combine={reverse_digits: {reverse_digits: 1.0, judge: 0.5}}",
                 f"reward.judge={{model: {model}, prompt_template: '{{response}}', engine: sglang}}"])  # fmt: skip
    assert code != 0, capsys.readouterr()
    assert (tmp_path / "out" / "summary.judge_sglang.log").is_file()
    assert set(Path(tempfile.gettempdir()).glob("megarl-evaluate-judge-*")) == before


def test_the_summary_says_a_worker_died_rather_than_that_the_function_raised():
    from megarl.commands.evaluate import format_table

    summary = {"per_data_source": {"all": {"reward/mean": 0.5}},
               "reward": {"errors": 3, "worker_deaths": 2, "timeouts": 1}}
    assert format_table(summary).splitlines()[-1] == (
        "reward functions raised on 1, the worker process died on 2 and timed out on 1 responses (scored 0)")
