"""The user's code run in the driver (a tool, an interaction, a generate function) that tries to
end the process: one `error:` line naming it, its file and what it did, exit code 2; never the
function's own exit code, never "stopped by Ctrl-C" (a real SIGINT stays the user's)."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

from megarl.cli import report
from megarl.data.batch import Batch
from megarl.rollout.agents.errors import AgentError
from megarl.rollout.agents.interactions import Interaction
from megarl.rollout.agents.tools import Tool, start_tool_call
from megarl.terminal import EXIT_USER
from megarl.user_code import UserCodeError, named_generate_function, raised_by_code

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_warning_said_yet(monkeypatch):
    """user_code warns once per piece of code and kind in a process: each test starts with none said."""
    import megarl.user_code

    monkeypatch.setattr(megarl.user_code, "_WARNED", set())

SCHEMA = {
    "type": "function",
    "function": {
        "name": "quits",
        "description": "d",
        "parameters": {"type": "object", "properties": {}},
    },
}


class Boom(BaseException):
    """A BaseException of the user's own (not an Exception): only a process's end raises one."""


class QuittingTool(Tool):
    def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("how") == "boom":
            raise Boom("custom")
        sys.exit(7)


class InterruptingUser:
    def __init__(self, config):
        self.raises = config.get("raises", KeyboardInterrupt)

    def start_interaction(self, instance_id, **kwargs):
        raise self.raises


@pytest.mark.parametrize(("how", "did"), [("exit", "called sys.exit(7)"),
                                         ("boom", "raised Boom (a BaseException, which only ends a process): custom")])  # fmt: skip
def test_a_tool_that_calls_sys_exit_stops_the_rollout_at_once_in_one_line(capsys, how, did):
    future = start_tool_call(QuittingTool({}, SCHEMA), {"how": how}, {})
    with pytest.raises(AgentError) as info:
        future.result(timeout=60)  # said at once: not left to the tool timeout
    message = str(info.value)
    assert message.startswith(f"tool 'quits' (QuittingTool in {__file__}) {did}; a tool must return text")
    assert report(info.value) == EXIT_USER and capsys.readouterr().err.startswith(
        "error: tool 'quits'"
    )


def test_an_interaction_that_raises_keyboard_interrupt_is_not_the_users_ctrl_c():
    with pytest.raises(
        AgentError,
        match=r"^interaction 'u' \(InterruptingUser.start_interaction in .*test_user_code.py\) "
        r"raised KeyboardInterrupt; an interaction must return its answer or raise",
    ):
        Interaction("u", InterruptingUser({})).session({})


def test_an_interaction_that_raises_a_base_exception_of_its_own_is_named():
    with pytest.raises(AgentError, match=r"^interaction 'u' \(InterruptingUser.start_interaction in .*test_user_code.py\) "
                                         r"raised Boom \(a BaseException, which only ends a process\): custom; an interaction "
                                         r"must return its answer or raise"):  # fmt: skip
        Interaction("u", InterruptingUser({"raises": Boom("custom")})).session({})


def _generate(engines, prompts, params):
    if prompts == "exit":
        sys.exit(9)
    raise RuntimeError("my bug")


@pytest.mark.parametrize(
    ("prompts", "did"), [("exit", "called sys.exit(9)"), ("raise", "raised RuntimeError: my bug")]
)
def test_a_generate_function_is_named_with_its_file(prompts, did, capsys):
    generate = named_generate_function(_generate, "my_pkg.rollouts:generate", returns=Batch)
    with pytest.raises(UserCodeError) as info:
        generate(None, prompts, None)
    assert str(info.value).startswith(
        f"rollout.generate_function my_pkg.rollouts:generate ({__file__}) {did}"
    )
    assert report(info.value) == EXIT_USER and capsys.readouterr().err.startswith(
        "error: rollout.generate_function"
    )


@pytest.mark.parametrize(("returned", "said"), [(None, "returned None, not a megarl.data.batch.Batch"),
                                                ({"responses": []}, "returned a dict ({'responses': []}), not a")])
def test_a_generate_function_that_returns_no_batch_is_one_line_naming_it(returned, said, capsys):
    """Before: None went on into megarl and ended in a 44-line traceback far from the function."""
    generate = named_generate_function(lambda engines, prompts, params: returned, "my_pkg.rollouts:generate", returns=Batch)
    with pytest.raises(UserCodeError) as info:
        generate(None, None, None)
    message = str(info.value)
    assert message.startswith(f"rollout.generate_function my_pkg.rollouts:generate ({__file__}) {said}"), message
    assert "a generate function must return a Batch of the responses" in message
    assert report(info.value) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: rollout.generate_function") and err.count("\n") == 1


def test_an_error_raised_inside_megarl_code_the_function_called_is_not_blamed_on_it(tmp_path):
    """The function's own bug is its own; an error from inside a megarl call it made (here a write
    into a folder that is gone; in a run, an engine actor's death) passes as it is, noting the function."""
    from megarl.kept_files import write_atomically

    def calls_megarl(engines, prompts, params):
        write_atomically(tmp_path / "gone" / "rows.txt", "x")

    generate = named_generate_function(calls_megarl, "my_pkg.rollouts:generate", returns=Batch)
    with pytest.raises(FileNotFoundError) as info:
        generate(None, [], None)
    assert any("rollout.generate_function my_pkg.rollouts:generate" in note for note in info.value.__notes__)


def test_a_ctrl_c_while_user_code_runs_stays_the_users():
    """A KeyboardInterrupt that the SIGINT handler raised (wherever the main thread was) is the
    user's own Ctrl-C: passed on as it is, not blamed on the code."""

    def busy_user_code():
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, arriving while this code runs
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pass

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            busy_user_code()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not raised_by_code(info.value)
    with pytest.raises(KeyboardInterrupt) as raised:
        raise KeyboardInterrupt
    assert raised_by_code(raised.value)

    class OneLiner:  # a dataset class's `def __len__(self): raise KeyboardInterrupt`
        def __len__(self): raise KeyboardInterrupt  # noqa: E704  # fmt: skip

    with pytest.raises(KeyboardInterrupt) as one_liner:
        len(OneLiner())
    assert raised_by_code(one_liner.value)


def test_megarls_own_signal_handler_is_never_blamed_on_the_generate_function():
    """Under a run's RunControl, Ctrl-C while the user's generate function runs reaches the trainer
    as the user's stop (a KeyboardInterrupt), not as the function ending the process; the same for
    the watchdog's hang interrupt."""
    from megarl.trainer.watchdog import RunControl

    def user_gen():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pass

    for how in ("ctrl-c", "hang"):
        wrapped = named_generate_function(user_gen, "mymod:user_gen", returns=Batch)
        with RunControl().handlers() as control:
            # the watchdog's thread interrupts the main thread as it does in a run
            timer = (threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)) if how == "ctrl-c"
                     else threading.Timer(0.3, control.interrupt_for_hang, ("no progress for 0.3 s",)))
            timer.start()
            with pytest.raises(KeyboardInterrupt) as info:
                wrapped()
            timer.join()
        assert not isinstance(info.value, UserCodeError) and not raised_by_code(info.value)


def test_after_a_stop_each_wait_on_user_code_gets_the_grace_from_its_own_start(monkeypatch):
    """A stop asked long before a wait began (a Ctrl-C during generation, then the rewards) does
    not cut that wait short: code that returns within STOP_GRACE_S of the wait's start is waited
    for; code that does not is given up on then, as what the run waited on (main thread only)."""
    import megarl.user_code
    from megarl.user_code import (
        DeadlinePassed,
        WaitAbandoned,
        call_with_deadline,
        current_wait,
        stop_requested,
    )

    monkeypatch.setattr(megarl.user_code, "STOP_GRACE_S", 1.5)
    never = threading.Event()
    stop_requested(time.monotonic() - 100)
    try:
        assert call_with_deadline(lambda: (time.sleep(0.3), 7)[1], 60, "quick code") == 7
        with pytest.raises(WaitAbandoned, match="^hung code was waited on for [12] s and did not return within 1.5 s of the stop$"):
            call_with_deadline(never.wait, 60, "hung code")
        assert current_wait() is None
        outcome: list[BaseException] = []

        def elsewhere() -> None:  # another thread (the asynchronous producer): its deadline as before
            try:
                call_with_deadline(never.wait, 2.0, "hung code")
            except BaseException as exc:  # noqa: BLE001 - the outcome is the test's result
                outcome.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], DeadlinePassed)
    finally:
        stop_requested(None)
        never.set()


def test_a_generate_function_that_hangs_past_a_stop_is_abandoned_and_the_stop_line_reaches_the_terminal(
        monkeypatch, tmp_path, capsys):
    """The generate function runs in the main thread itself: after a first Ctrl-C inside a step it
    gets STOP_GRACE_S, then the step is abandoned (WaitAbandoned naming it) as a second Ctrl-C
    would; the first signal's line goes to the terminal, not to the user-code log its prints go to."""
    import megarl.user_code
    from megarl.trainer.watchdog import RunControl
    from megarl.user_code import WaitAbandoned, user_output_to

    monkeypatch.setattr(megarl.user_code, "STOP_GRACE_S", 1.0)

    def hangs(engines, prompts, params):
        print("generating")
        os.kill(os.getpid(), signal.SIGINT)  # the user's first Ctrl-C, while the function runs
        time.sleep(120)  # (a blocking call: the interrupt ends it)

    log = tmp_path / "user_code.log"
    wrapped = named_generate_function(hangs, "mymod:hangs", returns=Batch)
    with user_output_to(log), RunControl().handlers() as control:
        control.deferred = True
        with pytest.raises(WaitAbandoned) as info:
            wrapped(None, None, None)
        control.cleaning = True
    assert re.fullmatch(r"rollout\.generate_function mymod:hangs \(.*test_user_code\.py\) ran for [1-9]\d* s "
                        r"and did not return within 1 s of the stop", str(info.value)), info.value
    err = capsys.readouterr().err
    assert "megarl: SIGINT (Ctrl-C) received: stopping after this step and saving a checkpoint; waiting at most 1 s more " \
           "for rollout.generate_function mymod:hangs" in err
    assert log.read_text() == "generating\n"


def test_a_generate_function_that_returns_within_the_grace_is_waited_for_and_not_interrupted_later(monkeypatch):
    """A call that returns within STOP_GRACE_S of the stop (or of its own start, when that came
    later) returns its Batch, and nothing interrupts the main thread after it returned."""
    import megarl.user_code
    from megarl.trainer.watchdog import RunControl

    monkeypatch.setattr(megarl.user_code, "STOP_GRACE_S", 1.0)
    one = torch.ones(1, 1, dtype=torch.long)  # a Batch of one 1-token response
    returned = Batch(one, one, one, torch.ones(1, dtype=torch.long), one.float(), torch.zeros(1, dtype=torch.long))

    def slow(engines, prompts, params):
        time.sleep(0.6)
        return returned

    wrapped = named_generate_function(slow, "mymod:slow", returns=Batch)
    with RunControl().handlers() as control:
        control.deferred = True
        os.kill(os.getpid(), signal.SIGINT)  # the stop, before the calls
        time.sleep(0.8)
        for _ in range(2):  # each gets the grace from its own start: 1.4 s after the stop, still returned
            assert wrapped(None, None, None) is returned
        time.sleep(1.5)  # past every call's grace: no interrupt comes once they returned
        control.cleaning = True


def test_a_generate_function_raising_a_base_exception_of_its_own_is_one_line_naming_it(capsys):
    def generate_fn(engines, prompts, params):
        raise Boom("custom")

    generate = named_generate_function(generate_fn, "my_pkg.rollouts:generate", returns=Batch)
    with pytest.raises(UserCodeError) as info:
        generate(None, None, None)
    assert str(info.value).startswith(f"rollout.generate_function my_pkg.rollouts:generate ({__file__}) raised Boom "
                                      "(a BaseException, which only ends a process): custom; raise an Exception")  # fmt: skip
    assert report(info.value) == EXIT_USER and capsys.readouterr().err.count("\n") == 1


def _its_own_handler(signum, frame):
    pass


def test_a_generate_function_that_changes_the_cwd_or_megarls_signal_handlers_has_them_put_back(tmp_path, caplog):
    # Before: a relative output folder pointed elsewhere after os.chdir (a lost checkpoint), and a
    # function that ignored SIGINT made the user's Ctrl-C (twice too) do nothing.
    def generate_fn(engines, prompts, params):
        os.chdir(tmp_path)
        signal.signal(signal.SIGINT, _its_own_handler)  # (not SIG_IGN: an xdist worker ignores SIGINT already)
        return Batch.__new__(Batch)

    before_cwd, before_int = os.getcwd(), signal.getsignal(signal.SIGINT)
    generate = named_generate_function(generate_fn, "my_pkg.rollouts:generate", returns=Batch)
    try:
        generate(None, None, None)
        generate(None, None, None)
        assert os.getcwd() == before_cwd and signal.getsignal(signal.SIGINT) == before_int
    finally:
        os.chdir(before_cwd)
        signal.signal(signal.SIGINT, before_int)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2, said  # once each, not per call
    cwd, handlers = sorted(said)  # ("changed the working directory" first)
    assert handlers.startswith("rollout.generate_function my_pkg.rollouts:generate") and "replaced megarl's handler of SIGINT" in handlers
    assert f"changed the working directory to {tmp_path}; put back to {before_cwd}" in cwd


@pytest.mark.parametrize(("does", "what"), [("dup2-devnull", "stdout and stderr"), ("close", "stdout and stderr"),
                                           ("sys-none", "sys.stdout and sys.stderr")])  # fmt: skip
def test_a_generate_function_that_redirects_or_closes_stdout_and_stderr_has_them_put_back(does, what):
    # Before: os.dup2 of /dev/null onto fds 1 and 2 (and a normal return) sent the run's later
    # lines (a checkpoint saved, a stop) nowhere, without a word. (A process of its own: the
    # streams are pytest's here.)
    import subprocess

    code = (f"import os\nfrom megarl.user_code import named_generate_function\ndef gen(*args):\n"
            f"    null = os.open(os.devnull, os.O_WRONLY)\n"
            f"    for fd in (1, 2):\n        os.dup2(null, fd) if {does == 'dup2-devnull'} else os.close(fd)\n"
            f"    return 0\n"
            f"if {does == 'sys-none'}:\n    import sys\n    def gen(*args):\n        sys.stdout = sys.stderr = None\n        return 0\n"
            "generate = named_generate_function(gen, 'my_pkg.rollouts:generate', returns=int)\n"
            "generate(); generate()\nprint('a line after it', flush=True)\nos.write(2, b'and on stderr')\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "a line after it\n", (done.stdout, done.stderr)
    said = done.stderr.splitlines()
    assert said == [f"rollout.generate_function my_pkg.rollouts:generate (<string>) closed or redirected the process's {what}; "
                    "put back: megarl's lines (a checkpoint saved, an error) go there", "and on stderr"], said  # fmt: skip


def test_megarls_own_move_of_a_stream_to_devnull_during_a_call_is_not_undone_nor_blamed():
    # A terminal that hangs up while a generate function runs: megarl's SIGHUP handler points fds 1
    # and 2 at /dev/null (every write there would fail); the call's end must not put the dead
    # terminal back, nor blame the function.
    import subprocess

    code = ("import os\nfrom megarl.std_streams import file_of, to_devnull\nfrom megarl.user_code import named_generate_function\n"
            "def gen(*args):\n    to_devnull(1)\n    return 0\n"
            "named_generate_function(gen, 'my_pkg.rollouts:generate', returns=int)()\n"
            "os.write(2, b'stdout on /dev/null: %s' % str(file_of(1) == os.stat(os.devnull)[1:3][::-1]).encode())\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "stdout on /dev/null: True", done.stderr


def test_a_stop_delivered_again_after_a_call_comes_once_its_streams_are_put_back():
    # megarl's handler of the stop delivered again may raise (a first stop outside a step): the
    # streams and the working directory must be put back before, not skipped.
    import subprocess

    code = ("import os, signal\nfrom megarl import stop_origin\nfrom megarl.user_code import named_generate_function\n"
            "r, w = os.pipe(); os.set_blocking(r, False); stop_origin._fds['announced'] = r\n"
            "def megarls(signum, frame):\n    raise RuntimeError('the stop')\n"
            "signal.signal(signal.SIGINT, megarls)\n"
            "def gen(*args):\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    os.write(w, bytes([signal.SIGINT]))\n"
            "    null = os.open(os.devnull, os.O_WRONLY)\n    os.dup2(null, 1); os.dup2(null, 2); os.chdir('/')\n    return 0\n"
            "cwd = os.getcwd()\n"
            "try:\n    named_generate_function(gen, 'g:g', returns=int)()\nexcept RuntimeError as exc:\n"
            "    print(exc, os.getcwd() == cwd, flush=True)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "the stop True\n", (done.stdout, done.stderr)


def test_the_last_line_reaches_the_user_when_user_code_closed_stderr(tmp_path):
    # A generate function that closed fds 1 and 2: the command ended rc 1 with nothing on the
    # terminal (its error line, written to a closed or reused fd 2, went nowhere).
    import subprocess

    code = ("import os\nfrom megarl.terminal import keep_stderr, error_line\nkeep_stderr()\nos.close(1)\nos.close(2)\n"
            f"reused = [os.open({str(tmp_path / 'other.txt')!r}, os.O_WRONLY | os.O_CREAT) for _ in range(2)]\n"
            "error_line('error: the last line')\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "error: the last line\n", done.stderr
    assert (tmp_path / "other.txt").read_text() == ""  # the file that took fds 1 and 2 got none of it
