"""The terminal's log handler writes to the stderr of the moment: under a live progress bar
(rich, as the training bar) its lines go through the bar's console, above the bar, not onto it."""

from __future__ import annotations

import io
import logging
import sys

from rich.console import Console
from rich.progress import Progress

from megarl.terminal import StderrNowHandler
from megarl.user_code import routed_again, running, user_output_to


def test_a_log_line_under_a_live_bar_goes_through_the_bar_s_console(monkeypatch):
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)  # the terminal logging was set up with
    handler = StderrNowHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    record = logging.LogRecord("megarl.progress", logging.INFO, __file__, 1, "saving checkpoint step 20 ... (5 s)", None, None)
    screen = io.StringIO()
    with Progress(console=Console(file=screen, force_terminal=True, width=80)) as bar:
        bar.add_task("step", total=4)
        handler.emit(record)  # rich's proxy of sys.stderr while the bar is live
    assert terminal.getvalue() == ""  # not written past the bar
    assert "saving checkpoint step 20 ... (5 s)" in screen.getvalue()
    handler.emit(record)  # the bar is gone: the terminal itself again
    assert terminal.getvalue() == "saving checkpoint step 20 ... (5 s)\n"


def test_user_code_under_a_live_bar_logs_to_the_terminal_and_prints_clean_lines_to_its_log(monkeypatch, tmp_path):
    """As in a run: user code's routing set up first, then the training bar (its console writes to
    the stdout of the moment, as the bar's default one). A log record from inside user code goes
    through the bar's proxy (cursor codes before it: above the bar) to the terminal, never to the
    user-code log; a tool's print reaches that log as printed, without the bar's codes."""
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    handler = StderrNowHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    record = logging.LogRecord("megarl.x", logging.WARNING, __file__, 1, "reward worker restarted", None, None)
    log = tmp_path / "user_code.log"
    with user_output_to(log):
        bar = Progress(console=Console(force_terminal=True, width=80), auto_refresh=False)
        with bar:
            bar.add_task("step", total=4)
            routed_again()  # as the training bar does once started
            with running("tool 'calc'"):
                handler.emit(record)
                print("tool says hi")
        shown = terminal.getvalue()
    assert "reward worker restarted" in shown
    before = shown[: shown.index("reward worker restarted")]
    assert before.rstrip("\x1b[0m").endswith("\x1b[2K")  # rich's cursor codes: through the proxy, above the bar
    assert "tool says hi" not in shown
    assert log.read_text() == "tool says hi\n"


def test_loading_hf_models_shows_no_progress_bar(tmp_path, capfd):
    """transformers' "Loading weights" bar, once per reward worker and engine: not on the terminal;
    the bar's setting is restored after."""
    from transformers.utils import logging as hf_logging

    from megarl.engines.torch_engine import _load_model
    from megarl.models.tiny import build_tiny_model, build_tiny_reward_model
    from megarl.rewards.reward_model import load_reward_model

    policy = build_tiny_model(tmp_path / "policy")
    reward = build_tiny_reward_model(tmp_path / "rm", policy)
    capfd.readouterr()
    hf_logging.enable_progress_bar()
    _load_model(policy, None, "cpu")
    load_reward_model(str(reward))
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "%|" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()
