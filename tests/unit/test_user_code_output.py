"""What the user's code prints in the driver (a tool, an interaction, a generate function) goes
to the run's user-code log, not the terminal, while megarl's own lines still reach the terminal;
an error about the code quotes the head of what it printed. An interaction that never returns
stops the run at its deadline with one line naming it."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import pytest
import torch

from megarl.cli import report
from megarl.data.batch import Batch
from megarl.rollout.agents.interactions import Interaction, InteractionTimeout
from megarl.rollout.agents.tools import Tool, start_tool_call
from megarl.terminal import EXIT_USER, setup_logging
from megarl.user_code import UserCodeError, named_generate_function, user_output_to

pytestmark = pytest.mark.timeout(120)

BIG = "x" * 200_000  # the attack's size: 200,000 characters per call
SCHEMA = {"type": "function", "function": {"name": "talk", "description": "d", "parameters": {"type": "object", "properties": {}}}}


class ChattyTool(Tool):
    def execute(self, instance_id, parameters, **kwargs):
        print("tool says " + BIG)
        print("tool warns", file=sys.stderr)
        return "ok"


class AsyncChattyTool(Tool):
    async def execute(self, instance_id, parameters, **kwargs):
        async def helper():  # a task of the tool's own: the mark follows it
            print("async tool task says hi")

        await asyncio.gather(helper())
        return "ok"


def test_a_tools_prints_go_to_the_log_and_megarls_lines_to_the_terminal(tmp_path, capsys):
    log = tmp_path / "logs" / "user_code.log"
    with user_output_to(log):
        assert start_tool_call(ChattyTool({}, SCHEMA), {}, {}).result(timeout=60).text == "ok"
        assert start_tool_call(AsyncChattyTool({}, SCHEMA), {}, {}).result(timeout=60).text == "ok"
        print("megarl: step 1 done")  # megarl's own output, outside user code
        print("megarl: a warning", file=sys.stderr)
    terminal = capsys.readouterr()
    assert terminal.out == "megarl: step 1 done\n" and terminal.err == "megarl: a warning\n"
    written = log.read_text()
    assert f"tool says {BIG}\n" in written and "tool warns\n" in written and "async tool task says hi\n" in written
    assert sys.stdout is not None and type(sys.stdout).__name__ != "RoutedStream"  # put back after the run


def test_user_code_that_prints_past_the_cap_is_dropped_with_one_marker_and_one_warning(tmp_path, caplog, capsys):
    """The driver's user-code log (a tool here) stops at reward.output_log_max_mb; megarl's own
    notes (a traceback) are still written after it."""
    from megarl.user_code import running, traceback_to_log

    log = tmp_path / "logs" / "user_code.log"
    with caplog.at_level(logging.WARNING, logger="megarl.output_cap"), user_output_to(log, 0.5):
        with running("tool loud"):
            for _ in range(8):
                print("z" * 100_000)
        traceback_to_log("tool loud", ValueError("kept"))
    written = log.read_text()
    marker = "\n[megarl: user code's output past 0.5 MB dropped from here]\n"
    head, _, rest = written.partition(marker)
    assert len(head) == 1 << 19 and set(head) <= {"z", "\n"} and "ValueError: kept" in rest and "zzz" not in rest
    assert [r.getMessage() for r in caplog.records] == [f"user code printed more than 0.5 MB: {log} keeps the first 0.5 MB; "
                                                         "print less (or raise reward.output_log_max_mb)"]  # fmt: skip
    assert "zzz" not in capsys.readouterr().out


def _calls_megarl(engines, prompts, params):
    print("generate prints")
    logging.getLogger("megarl.engines").warning("engine 0 is slow")  # megarl's own, in a call the function made
    one = torch.ones(1, 1, dtype=torch.long)  # what the contract asks: a Batch (here of one 1-token response)
    return Batch(one, one, one, torch.ones(1, dtype=torch.long), one.float(), torch.zeros(1, dtype=torch.long))


def test_megarls_log_records_still_reach_the_terminal_even_from_inside_user_code(tmp_path, capsys):
    root = logging.getLogger()
    handlers = root.handlers[:]
    root.handlers.clear()
    try:
        setup_logging()
        with user_output_to(tmp_path / "user_code.log"):
            start_tool_call(ChattyTool({}, SCHEMA), {}, {}).result(timeout=60)
            logging.getLogger("megarl.trainer").warning("step 1 took long")
            named_generate_function(_calls_megarl, "my_pkg:generate", returns=Batch)(None, None, None)
    finally:
        root.handlers[:] = handlers
    err = capsys.readouterr().err
    assert "step 1 took long" in err and "engine 0 is slow" in err and "tool" not in err and "prints" not in err
    assert (tmp_path / "user_code.log").read_text().endswith("generate prints\n")


def _chatty_generate(engines, prompts, params):
    print("generate says " + BIG)
    raise RuntimeError("my bug")


def test_a_generate_functions_prints_go_to_the_log_and_its_error_quotes_their_head(tmp_path, capsys):
    from megarl.commands.generate import user_code_log

    log = user_code_log(tmp_path / "out.jsonl")  # `megarl generate`'s: it has no run log for the traceback
    generate = named_generate_function(_chatty_generate, "my_pkg.rollouts:generate", returns=Batch)
    with user_output_to(log), pytest.raises(UserCodeError) as info:
        generate(None, None, None)
    assert capsys.readouterr().out == ""
    printed, traceback = log.read_text().split("\n", 1)  # its print, then the traceback the error names
    assert printed == f"generate says {BIG}"
    assert traceback.startswith("[megarl] rollout.generate_function my_pkg.rollouts:generate (") and traceback.endswith(
        "RuntimeError: my bug\n") and "_chatty_generate" in traceback
    message = str(info.value)
    assert f"fix the function (the traceback is in {log}); it printed" in message
    assert "raised RuntimeError: my bug" in message and f"it printed: 'generate says {'x' * 100}" in message
    assert message.endswith(f"... (all of it in {log})") and len(message) < 1000  # the head, not 200,000 characters
    assert report(info.value) == EXIT_USER


class ChattyUser:
    def __init__(self, config):
        pass

    def start_interaction(self, instance_id, **kwargs):
        print("user starts " + BIG)
        return instance_id

    def generate_response(self, instance_id, messages, **kwargs):
        print("user answers")
        return True, "fine", 1.0, {}


def test_an_interactions_prints_go_to_the_log(tmp_path, capsys):
    log = tmp_path / "user_code.log"
    with user_output_to(log):
        reply = Interaction("u", ChattyUser({})).session({}).respond([])
    assert reply.text == "fine" and capsys.readouterr().out == ""
    assert log.read_text() == f"user starts {BIG}\nuser answers\n"


class HangingUser(ChattyUser):
    def __init__(self, config):
        self.release = threading.Event()

    def generate_response(self, instance_id, messages, **kwargs):
        print("thinking...")
        self.release.wait()  # never set in time: the call does not return
        return True, "late", 0.0, {}

    def finalize_interaction(self, instance_id):
        raise AssertionError("finalize_interaction ran after a hung generate_response")


def test_an_interaction_that_never_returns_is_one_line_naming_it_at_its_deadline(tmp_path, capsys):
    user = HangingUser({})
    with user_output_to(tmp_path / "user_code.log"):
        session = Interaction("u", user, timeout_s=0.5).session({})
        with pytest.raises(InteractionTimeout) as info:
            session.respond([])
        session.finish()  # skipped: its state is the hung call's
    user.release.set()
    message = str(info.value)
    assert message.startswith(f"interaction 'u' (HangingUser.generate_response in {__file__}) did not return within 0.5 s; ")
    assert "rollout.agent.interaction_timeout_s" in message and "it printed: 'thinking...\\n'" in message
    assert report(info.value) == EXIT_USER and capsys.readouterr().err.startswith("error: interaction 'u'")


def test_a_log_that_cannot_be_written_drops_the_prints_not_the_tool(tmp_path, capsys):
    """A full disk (here: the log's folder is a file) must not turn the tool's print into its failure."""
    (tmp_path / "logs").write_text("not a folder")
    with user_output_to(tmp_path / "logs" / "user_code.log"):
        outcome = start_tool_call(ChattyTool({}, SCHEMA), {}, {}).result(timeout=60)
    assert outcome.text == "ok" and outcome.error is None and capsys.readouterr().out == ""
