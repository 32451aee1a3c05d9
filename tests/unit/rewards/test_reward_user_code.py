"""Reward functions that try to end their process, kill their worker or print: real functions in a
real worker pool. Each is named as the user's code in one RewardError (never passed on as the
function's own exit code or as the user's Ctrl-C), within a few samples, and its output goes to
the scorer's log file, quoted in the error, not to the terminal."""

from __future__ import annotations

import logging
import textwrap

import pytest

from megarl.config.sections import CustomRewardConfig, RewardConfig
from megarl.rewards import RewardScorer
from megarl.rewards import scorer as scorer_module
from megarl.rewards.scorer import DEATHS_IN_A_ROW, RewardError

pytestmark = pytest.mark.timeout(
    300
)  # the hang guard; the tests assert outcomes, not elapsed times

TIMEOUT_S = (
    120.0  # far beyond the tests' own length: a death reported as a timeout would hold them there
)
REWARDS = textwrap.dedent(
    """
    import os, sys, time

    def exits(data_source, solution_str, ground_truth, extra_info=None):
        print("about to exit on", solution_str)
        sys.exit(3)

    def interrupts(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyboardInterrupt

    def generator_exit(data_source, solution_str, ground_truth, extra_info=None):
        raise GeneratorExit

    class Boom(BaseException):
        pass

    def own_base_exception(data_source, solution_str, ground_truth, extra_info=None):
        raise Boom("custom")

    def exits_quietly(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("ok"):
            return 1.0
        print("leaving", solution_str, flush=True)
        os._exit(0)

    def exits_one(data_source, solution_str, ground_truth, extra_info=None):
        os._exit(1)

    def prints(data_source, solution_str, ground_truth, extra_info=None):
        print("PRINTED", solution_str)
        print("WARNED", solution_str, file=sys.stderr)
        return 1.0

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.3)
        return 1.0

    def batch_exits(data_sources, solution_strs, ground_truths, extra_infos):
        sys.exit(4)
    """
)


def _scorer(tmp_path, name: str, *, batched: bool = False) -> RewardScorer:
    path = tmp_path / "user_reward.py"
    path.write_text(REWARDS)
    cfg = RewardConfig(
        custom=CustomRewardConfig(path=str(path), name=name, batched=batched),
        timeout_s=TIMEOUT_S,
        workers=2,
    )
    return RewardScorer(cfg, log_path=tmp_path / "logs" / "reward_workers.log")


def _score(scorer: RewardScorer, solutions: list[str]):
    n = len(solutions)
    return scorer.score(["task"] * n, solutions, ["x"] * n, [None] * n)


@pytest.mark.parametrize(
    ("name", "did"),
    [
        ("exits", "called sys.exit(3)"),
        ("interrupts", "raised KeyboardInterrupt"),
        ("generator_exit", "raised GeneratorExit"),
        ("own_base_exception", "raised Boom (a BaseException, which only ends a process): custom"),
    ],
)
def test_a_function_that_ends_its_process_stops_the_call_in_one_line(tmp_path, name, did):
    with _scorer(tmp_path, name) as s, pytest.raises(RewardError) as info:
        _score(s, [f"r{i}" for i in range(6)])
    message = str(info.value)
    assert message.startswith(
        f"reward.custom {name!r} (user_reward.py) {did} while scoring data_source='task'"
    ), message
    assert "never end the process" in message and "\n" not in message
    # the other worker's exit, in the shared log meanwhile, is not quoted as this call's output
    assert "Traceback" not in message and "megarl:" not in message, message
    log = (tmp_path / "logs" / "reward_workers.log").read_text()
    assert (
        did.removeprefix("raised ").removeprefix("called ") in log
    )  # its traceback, for the line's reader
    if name == "exits":  # what it printed: in the log, quoted in the error
        assert "about to exit on r" in log and "there: 'about to exit on r" in message


def test_a_batched_function_that_calls_sys_exit_is_named(tmp_path):
    with (
        _scorer(tmp_path, "batch_exits", batched=True) as s,
        pytest.raises(RewardError, match=r"called sys.exit\(4\)"),
    ):
        _score(s, ["a", "b"])


def test_a_worker_that_exits_with_code_0_is_a_death_not_a_timeout(tmp_path, caplog):
    """pebble says nothing of a worker that exits with code 0: the scorer sees its task's worker
    gone, well before reward.timeout_s; one such sample scores 0, the others are scored."""
    with (
        _scorer(tmp_path, "exits_quietly") as s,
        caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"),
    ):
        result = _score(s, ["ok 0", "die", "ok 1", "ok 2"])
        assert result.scores == [1.0, 0.0, 1.0, 1.0]
        assert (result.errors, result.timeouts) == (1, 0)
        assert (
            "the worker process died (exit code 0) while scoring data_source='task' response='die'"
            in caplog.text
        )
        assert _score(s, ["ok 3"]).scores == [1.0]  # the pool goes on


@pytest.mark.parametrize(("name", "code"), [("exits_quietly", 0), ("exits_one", 1)])
def test_a_function_that_kills_every_worker_stops_after_a_few_samples(
    tmp_path, name, code, monkeypatch
):
    """Not one respawn per sample: DEATHS_IN_A_ROW samples that end their worker stop the call."""
    with _scorer(tmp_path, name) as s, pytest.raises(RewardError) as info:
        _score(s, [f"die {i}" for i in range(40)])
    message = str(info.value)
    assert message.startswith(
        f"reward.custom {name!r} (user_reward.py): the worker process died (exit code {code}) "
        "while scoring data_source='task'"
    ), message
    assert (
        f"{DEATHS_IN_A_ROW} samples in a row ended their worker" in message
        and "os._exit" in message
    )
    # -11 given as what a segfault's code would be, not as this worker's
    assert message.endswith("look for os._exit, or a crash in C code (which ends a worker with a negative exit code: "
                            "-11 for a segfault)"), message
    if code == 0:  # its last words, quoted from the log
        assert "there: '" in message and "leaving die" in message


def test_printed_output_goes_to_the_log_file_not_the_terminal(tmp_path, capfd):
    with _scorer(tmp_path, "prints") as s:
        assert _score(s, ["a", "b"]).scores == [1.0, 1.0]
    out, err = capfd.readouterr()
    assert "PRINTED" not in out + err and "WARNED" not in out + err
    log = (tmp_path / "logs" / "reward_workers.log").read_text()
    assert "PRINTED a" in log and "WARNED b" in log


LOUD = textwrap.dedent(
    """
    import sys

    def loud(data_source, solution_str, ground_truth, extra_info=None):
        sys.stdout.write("x" * 599_999 + "\\n")  # (a line: written at once, line buffering)
        sys.stderr.write("y" * 599_999 + "\\n")
        return 1.0
    """
)


def test_a_function_that_prints_megabytes_is_capped_in_its_log_with_one_warning(tmp_path, caplog, capfd):
    """Each call prints 1.2 MB; the cap of 1 MB holds across calls (the workers append past the
    marker, cut again), one warning says so, and the scores are unharmed."""
    (tmp_path / "loud.py").write_text(LOUD)
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(tmp_path / "loud.py"), name="loud"), timeout_s=TIMEOUT_S,
                       workers=2, output_log_max_mb=1)  # fmt: skip
    log = tmp_path / "logs" / "reward_workers.log"
    with caplog.at_level(logging.WARNING, logger="megarl.output_cap"), RewardScorer(cfg, log_path=log) as s:
        for _ in range(3):
            assert _score(s, ["a", "b", "c"]).scores == [1.0, 1.0, 1.0]
            written = log.read_bytes()
            marker = b"\n[megarl: reward functions' output past 1 MB dropped from here]\n"
            assert written.endswith(marker) and len(written) == (1 << 20) + len(marker), len(written)
            assert set(written[: 1 << 20]) <= set(b"xy\n")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"reward functions printed more than 1 MB: {log} keeps the first 1 MB; print less (or raise "
                        "reward.output_log_max_mb)"]  # fmt: skip
    out, err = capfd.readouterr()
    assert "xxxx" not in out + err and "yyyy" not in out + err


STREAMING = textwrap.dedent(
    """
    import os

    def streams(data_source, solution_str, ground_truth, extra_info=None):
        for _ in range(1000):  # 4 MB in 4 KB lines, straight to the fd: written while the driver cuts the log
            os.write(1, b"s" * 4095 + b"\\n")
        return 1.0
    """
)


def test_the_cap_holds_while_workers_write_as_the_log_is_cut(tmp_path):
    """Two workers append without pause while the driver cuts the log: what they appended between
    the marker and the driver's look at the file was kept past the marker at every later cut (6 MB
    past a 1 MB cap in a run). The log ends at the cap and the marker, written once, at the cut."""
    (tmp_path / "streams.py").write_text(STREAMING)
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(tmp_path / "streams.py"), name="streams"), timeout_s=TIMEOUT_S,
                       workers=2, output_log_max_mb=1)  # fmt: skip
    log = tmp_path / "logs" / "reward_workers.log"
    marker = b"\n[megarl: reward functions' output past 1 MB dropped from here]\n"
    with RewardScorer(cfg, log_path=log) as s:
        for _ in range(2):
            assert _score(s, [str(i) for i in range(16)]).scores == [1.0] * 16
            written = log.read_bytes()
            assert len(written) == (1 << 20) + len(marker), len(written)
            assert written[1 << 20 :] == marker and set(written[: 1 << 20]) == set(b"s\n")


def test_output_log_max_mb_0_keeps_everything(tmp_path):
    (tmp_path / "loud.py").write_text(LOUD)
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(tmp_path / "loud.py"), name="loud"), timeout_s=TIMEOUT_S,
                       workers=2, output_log_max_mb=0)  # fmt: skip
    log = tmp_path / "logs" / "reward_workers.log"
    with RewardScorer(cfg, log_path=log) as s:
        _score(s, ["a", "b"])
    assert log.stat().st_size == 2 * 1_200_000 and b"megarl:" not in log.read_bytes()


def test_a_log_no_worker_wrote_to_is_removed(tmp_path):
    with _scorer(tmp_path, "slow") as s:
        _score(s, ["a"])
    assert not (tmp_path / "logs" / "reward_workers.log").exists()


def test_a_long_call_logs_its_progress(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(scorer_module, "PROGRESS_EVERY_S", 0.5)
    with (
        _scorer(tmp_path, "slow") as s,
        caplog.at_level(logging.INFO, logger="megarl.rewards.scorer"),
    ):
        _score(s, [f"r{i}" for i in range(12)])
    lines = [r.getMessage() for r in caplog.records if "samples scored" in r.getMessage()]
    assert lines and all(
        line.startswith("reward: ") and "/12 samples scored (" in line for line in lines
    ), lines


@pytest.mark.parametrize(
    ("ending", "said"),
    [
        (
            "sys.exit(3)",
            "reward.custom 'f' (at_import.py) called sys.exit(3) while it was imported",
        ),
        # pebble replaces a worker that exits with code 0 without a word: not a 60 s "did not finish"
        (
            "os._exit(0)",
            "reward.custom: a reward worker died while importing 'at_import.py' before it took a sample",
        ),
    ],
)
def test_a_reward_file_that_ends_its_worker_at_import_is_named(tmp_path, ending, said):
    path = tmp_path / "at_import.py"
    path.write_text(
        f"import os, sys\n{ending}\n\ndef f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    cfg = RewardConfig(custom=CustomRewardConfig(path=str(path), name="f"), workers=2)
    with pytest.raises(RewardError) as info:
        RewardScorer(cfg, log_path=tmp_path / "reward_workers.log")
    assert str(info.value).startswith(said), info.value


def test_a_kept_load_error_is_raised_again_with_the_traceback_of_its_load(tmp_path):
    """A reward.functions file that fails to import fails each of the worker's tasks with its load
    error; raised as the one kept object, its traceback gathered every task's frames."""
    import traceback

    from megarl.rewards import worker

    file = tmp_path / "broken.py"
    file.write_text("def helper():\n    raise ValueError('no table')\n\nhelper()\n\ndef fn(*args):\n    return 1.0\n")
    spec = f"{file}:fn"
    lengths = []
    try:
        for _ in range(4):
            with pytest.raises(ValueError, match="no table") as raised:
                worker._user_function(spec)
            frames = traceback.extract_tb(raised.value.__traceback__)
            assert any(frame.name == "helper" for frame in frames)  # where the import failed
            lengths.append(len(frames))
    finally:
        for key in ("functions", "function_errors", "first_tracebacks"):
            worker._WORKER.pop(key, None)
    assert len(set(lengths[1:])) == 1, lengths  # the same each time


TAKES_TURNS = textwrap.dedent(
    """
    import time

    def interrupts_in_turn(data_source, solution_str, ground_truth, extra_info=None):
        print("started", solution_str, flush=True)
        if solution_str == "second":  # raise once the first one's traceback is in the shared log (ground_truth)
            deadline = time.monotonic() + 60
            while "KeyboardInterrupt" not in open(ground_truth).read() and time.monotonic() < deadline:
                time.sleep(0.05)
        raise KeyboardInterrupt
    """
)


def _exit_output(spec: dict, solution: str, results) -> None:
    """A reward worker's initializer and task in a process of its own: the output its UserExit quotes."""
    import multiprocessing as mp

    from megarl.rewards import worker

    worker.init_worker(spec, mp.Value("i", 0), mp.Value("d", 0.0))
    try:
        worker.score_samples([None], [("task", solution, spec["log"], None)])
    except worker.UserExit as exc:
        results.put((solution, exc.output))


def test_a_call_quotes_its_own_output_not_another_workers_traceback(tmp_path):
    """Two workers share the log: the second's exit came after the first's traceback was written
    there, which its error line quoted as its output (300 characters of escaped traceback)."""
    import multiprocessing as mp

    (tmp_path / "turns.py").write_text(TAKES_TURNS)
    log = tmp_path / "reward_workers.log"
    log.touch()
    spec = {"custom": (str(tmp_path / "turns.py"), "interrupts_in_turn"), "log": str(log)}
    context = mp.get_context("spawn")
    results = context.Queue()
    second = context.Process(target=_exit_output, args=(spec, "second", results))
    second.start()
    while "started second" not in log.read_text():  # (its call's output starts before the first one's exit)
        second.join(0.05)
        assert second.is_alive()
    first = context.Process(target=_exit_output, args=(spec, "first", results))
    first.start()
    outputs = dict(results.get(timeout=120) for _ in range(2))
    for process in (first, second):
        process.join(60)
    assert "Traceback" in log.read_text()  # the first's, between the second's lines
    # (the first one's line, printed meanwhile, is quoted too: the workers' lines interleave)
    assert outputs == {"first": "started first\n", "second": "started second\nstarted first\n"}
