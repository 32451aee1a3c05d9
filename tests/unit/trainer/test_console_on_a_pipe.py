"""The console's progress when stdout is no terminal (`megarl launch ... > out.log`, a pipe,
Slurm's output): a rich bar would show nothing until the end, so megarl/trainer/metric_sinks.py
prints plain lines, for the first step, then at most every NOTE_EVERY_S, and always the last;
no terminal codes. A real pipe for the command's stdout; a clock of the test's own."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from megarl.progress import NOTE_EVERY_S
from megarl.trainer import metric_sinks
from megarl.trainer.metric_sinks import ConsoleSink, _StepLines

STEP = {"reward/mean": 0.41, "actor/kl": 0.002, "time/step_s": 0.12}


def test_a_line_for_the_first_step_then_every_few_seconds_and_the_last(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(metric_sinks, "_say", said.append)
    now = [0.0]
    lines = _StepLines(500, clock=lambda: now[0])
    for step in range(1, 501):
        now[0] += 0.5  # a step every half second: 250 s in all
        lines.log(step, STEP | ({"val/reward/mean": 0.5} if step == 250 else {}))
    lines.close()
    steps = [line for line in said if not line.startswith("step 250: validation")]
    assert said[0] == "step 1/500  reward 0.410  kl 0.002  s/step 0.12"
    assert steps[-1].startswith("step 500/500  ") and "step 250: validation reward 0.500" in said
    assert 250 / NOTE_EVERY_S <= len(steps) <= 250 / NOTE_EVERY_S + 2  # not one per step
    assert not any("\x1b" in line for line in said)


def test_a_run_that_ends_early_says_its_last_step(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(metric_sinks, "_say", said.append)
    lines = _StepLines(500, clock=lambda: 0.0)  # no time passes: only the first step is due
    for step in (1, 2, 3):
        lines.log(step, {"sft/loss": 1.5, "reward/errors": 2.0})
    assert said == ["step 1/500  reward errors 2  loss 1.5"]
    lines.close()
    assert said[-1] == "step 3/500  reward errors 2  loss 1.5"


def test_the_console_sink_writes_plain_lines_to_a_pipe():
    """The sink in a process whose stdout is a pipe: lines as they come, no bar, no ANSI codes."""
    code = ("from megarl.trainer.metric_sinks import ConsoleSink\n"
            "sink = ConsoleSink(total_steps=2)\n"
            f"sink.log(1, {STEP!r})\nimport sys; sys.stdout.flush(); input()\n"
            f"sink.log(2, {STEP!r})\nsink.close()\n")  # fmt: skip
    env = {**os.environ, "TERM": "xterm-256color", "FORCE_COLOR": ""}
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None and child.stdin is not None
    first = child.stdout.readline()  # before the run ends: a bar would have shown nothing yet
    child.stdin.write("\n")
    child.stdin.close()
    rest = child.stdout.read()
    assert child.wait(timeout=120) == 0
    assert first == "step 1/2  reward 0.410  kl 0.002  s/step 0.12\n"
    assert rest == "step 2/2  reward 0.410  kl 0.002  s/step 0.12\n"


def test_on_a_terminal_it_is_the_bar(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    sink = ConsoleSink(total_steps=3)
    sink._progress.console.file = io.StringIO()
    sink.log(1, STEP)
    assert sink._progress.tasks[0].completed == 1 and "kl 0.002" in sink._progress.tasks[0].fields["info"]
    sink.close()


def test_a_closed_stdout_ends_no_run():
    """`megarl launch ... | head -1`: once head has gone, a step line fails with EPIPE; the lines
    stop (said once in the log), the run goes on, and nothing fails at exit either."""
    code = ("import sys\nfrom megarl.trainer.metric_sinks import _StepLines\nlines = _StepLines(3, clock=iter(range(0, 900, 60)).__next__)\n"
            "for step in (1, 2, 3):\n    lines.log(step, {'reward/mean': 0.5})\nlines.close()\nprint('more of the run')\n"
            "print('alive', file=sys.stderr)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader gone before the first line (the child is still importing)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert err.count("stdout is closed") == 1 and err.rstrip().endswith("alive"), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
