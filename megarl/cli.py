"""The `megarl` command line: the user's manual is `megarl --help` and each subcommand's help.

Each subcommand lives in megarl/commands/ (``register`` adds it to the parser); handlers import
heavy libraries (torch, megatron, ray) lazily inside themselves, so `megarl plan` stays fast.

Errors a user can cause (a config value, a data file, a checkpoint, a reward function, a path,
one of these met in a worker, a worker that died) end as one ``error: ...`` line naming the problem and the fix, with exit
code 2 (EXIT_USER); the traceback goes to the run's log (and to the terminal with --debug).
Anything else is a megarl bug, as is a failed assert in a worker: its traceback is printed and
the exit code is 1.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import traceback

from megarl import __version__
from megarl.std_streams import to_devnull
from megarl.terminal import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_SIGINT,
    EXIT_USER,
    LOG_LEVEL_ENV,
    LOG_LEVELS,
    error_line,
    keep_stderr,
    setup_logging,
)

EPILOG = """examples:
  megarl plan configs/qwen72b_grpo.yaml                 check a config, print the GPU placement
  megarl plan configs/tiny_grpo.yaml rollout.n=16 --json overrides are key.path=value (YAML values)

exit codes:
  0    done
  1    internal error: a traceback follows (a megarl bug, or an assert in a worker; please report it)
  2    user error: one `error:` line names the problem and the fix (command line, config, data,
       checkpoint, reward function, paths, a worker that raised or died); --debug adds the traceback
  130  stopped by Ctrl-C (SIGINT); 143 stopped by SIGTERM; 129 stopped by SIGHUP (the terminal
       closed: the end is in logs/driver.log); 131 stopped at once by Ctrl-\\ (SIGQUIT): the last
       checkpoint and the resume command are printed; 128+N stopped by another signal N whose
       default would end the command, as by SIGTERM (142: SIGALRM; SIGXCPU, SIGPWR, the
       real-time signals): its line names the signal
"""

# The project's user-facing errors, by the module that defines each (one that re-exports it may
# not be imported when it is raised): only modules already imported are looked at, so reporting
# an error never imports ray or torch.
USER_ERRORS = (
    ("megarl.config.loading", "ConfigError"),
    ("megarl.plan.issues", "PlanError"),
    ("megarl.config.architectures", "ArchError"),
    ("megarl.data.datasets", "DataError"),
    ("megarl.rollout.agents.errors", "AgentError"),
    ("megarl.evaluation", "EvaluationError"),
    ("megarl.commands.generate_partial", "GenerateError"),
    ("megarl.commands.sft", "SFTError"),
    ("megarl.checkpoint.verification", "CheckpointError"),
    ("megarl.commands.outputs", "OutputError"),
    ("megarl.checkpoint.model_checkpoint", "ModelCheckpointError"),
    ("megarl.commands.sbatch", "SbatchError"),
    ("megarl.rewards.scorer", "RewardError"),
    ("megarl.ray_cluster.worker_error", "WorkerError"),
    ("megarl.trainer.watchdog", "HangError"),
    ("megarl.rollout.producer", "RolloutStalled"),
    ("megarl.weight_sync.progress", "WeightPushTimeout"),
    ("megarl.checkpoint.metrics_history", "MetricsFileError"),
    ("megarl.trainer.metric_sinks", "MetricsSinkError"),
    ("megarl.rollout_sglang.server", "ServerLaunchError"),
    ("megarl.trainer.run_lock", "OutputDirInUse"),
    ("megarl.trainer.sample_files", "RolloutDumpError"),
    ("megarl.disk_full", "DiskFullError"),
    ("megarl.user_code", "UserCodeError"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="RL post-training of LLMs: Megatron-core trains, SGLang generates, Ray drives. "
        "Every config is checked (topology, batches, memory) before anything starts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of an error; also after the command (or MEGARL_DEBUG=1)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None, metavar="LEVEL",
                        help="debug, info (the default), warning or error: megarl's log level in the driver and every "
                        "worker (or MEGARL_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from megarl.commands import (
        config,
        convert,
        data,
        demo,
        doctor,
        evaluate,
        generate,
        launch,
        plan,
        plot,
        sbatch,
        sft,
    )

    for command in (plan, launch, config, convert, demo, plot, data, sft, generate, evaluate, sbatch, doctor):
        command.register(sub)
    _set_up_subcommands(sub)
    return parser


def _set_up_subcommands(sub: argparse._SubParsersAction) -> None:
    """``--debug`` after the (sub)command too: `megarl launch cfg.yaml --debug` (SUPPRESS keeps
    the top-level flag's value when a subcommand's is absent). No abbreviated flags: `--d` would
    pick --data or --debug by which flags exist, and a new flag would change what an old command line means."""
    for command in sub.choices.values():
        command.allow_abbrev = False
        if "--debug" not in command._option_string_actions:
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if "--log-level" not in command._option_string_actions:
            command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _set_up_subcommands(action)


def main(argv: list[str] | None = None) -> int:
    from megarl.driver_supervisor import report as report_to_supervisor
    from megarl.driver_supervisor import supervised, take_report_pipe
    from megarl.process_signals import forks_pass_stops_on

    _closed_std_streams_to_devnull()
    keep_stderr()  # the last line reaches the user even if user code in the driver closes fd 2
    take_report_pipe()  # `megarl launch`'s driver, started by its supervisor (megarl/driver_supervisor.py)
    _stacks_on_request()
    if supervised():  # a stop sent to a process it forks (it carries this command line) is the driver's
        forks_pass_stops_on()
    code: object = None
    try:
        code = _main(argv)
        return code
    except KeyboardInterrupt:  # a Ctrl-C while the command starts (its imports), before any handler of its own
        print("interrupted (Ctrl-C) while starting; nothing was started", file=sys.stderr)
        code = EXIT_SIGINT
        return code
    except SystemExit as exc:
        code = exc.code
        raise
    finally:  # the driver ended on its own (a quick exit of Ray's in C never gets here)
        report_to_supervisor(end=code)
        if supervised():  # (an exception on its way out, no code: megarl's own failure)
            _teardown_ends_on_a_stop(EXIT_INTERNAL if code is None and sys.exc_info()[1] is not None else code)


def _closed_std_streams_to_devnull() -> None:
    """A command started with stdin, stdout or stderr closed (`>&-`, `2>&-`, a bare daemon start)
    gets /dev/null there: Python leaves such a stream None (the first flush of it ended the command
    with a traceback), and the next file opened would take the free descriptor and receive what
    is written to fd 1 or 2 (by Ray, a library's C code, a child). What the user closed stays
    unseen; the exit code still says how the command ended."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        to_devnull(fd)
        if getattr(sys, name) is None:
            stream = open(fd, "r" if fd == 0 else "w", closefd=False)  # noqa: SIM115 - the process's own, for its life
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)


def _teardown_ends_on_a_stop(code: object) -> None:
    """A supervised driver that reported its end: a stop during the interpreter's teardown (the
    atexit finalizers of torch and Ray) ends it at once with the reported code, the finalizers not
    yet run skipped. Python's own handler would raise KeyboardInterrupt inside a finalizer, a
    traceback of a teardown the run no longer needs; what it leaves, the supervisor ends
    (megarl/tagged_processes.py). (No flush: a stalled terminal would hold the stop there; the
    run's lines were flushed as they were written.)"""
    import signal

    from megarl.signal_kinds import STOPS

    exit_code = code if isinstance(code, int) else (0 if code is None else 1)

    def end(signum: int, frame: object) -> None:
        os._exit(exit_code)

    for signum in STOPS:
        signal.signal(signum, end)


def _stacks_on_request() -> None:
    """`kill -USR1 <pid>` (or -USR2) makes this process write every thread's Python stack to
    stderr and go on (Python's default for them would end the process without a word); a
    supervisor passes them on to its driver instead (megarl/driver_supervisor.py)."""
    import faulthandler
    import signal

    from megarl.signal_kinds import STACKS_SIGNALS

    for signum in STACKS_SIGNALS:
        try:
            # faulthandler skips installing its handler when it thinks it already has (a Python-level
            # signal.signal since may have put the default back): unregister first. The process's
            # own stderr: sys.stderr may be a stream without a file descriptor.
            faulthandler.unregister(signum)
            # faulthandler writes the stacks at once, from C (a main thread stuck in C code too), then
            # chains to this Python handler, whose line says what they were once the main thread
            # runs Python again (late, or never, if it stays stuck), on the same descriptor.
            stream = sys.__stderr__ or sys.stderr
            signal.signal(signum, functools.partial(_stacks_written, stream.fileno()))
            faulthandler.register(signum, file=stream, all_threads=True, chain=True)
        except (AttributeError, RuntimeError, ValueError, io.UnsupportedOperation):  # no stderr fd
            signal.signal(signum, signal.SIG_IGN)  # no stacks then, but never the default's silent end


def _stacks_written(fd: int, signum: int, frame: object) -> None:
    import signal

    line = (f"megarl: the Python stacks above are every thread of pid {os.getpid()}, written on request "
            f"({signal.Signals(signum).name}); the command goes on\n")
    try:
        os.write(fd, line.encode())
    except OSError:  # no stderr to write to: the stacks did not get there either
        pass


def _main(argv: list[str] | None) -> int:
    from megarl.commands.convert import expand_short_form

    parser = build_parser()
    argv = expand_short_form(list(sys.argv[1:] if argv is None else argv))  # `convert CKPT OUT`
    # KEY=VALUE overrides may also come after options (`launch cfg.yaml --address auto rollout.n=4`).
    # A word there that is no override (`trainer.seed`) is one too, for the override check's
    # message, which names it; an unknown option is argparse's to refuse.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-")] if hasattr(args, "overrides") else extra
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.argv = argv  # for a command that runs itself again in a child (launch: megarl/driver_supervisor.py)
    level = args.log_level or os.environ.get(LOG_LEVEL_ENV, "").lower() or "info"
    if level not in LOG_LEVELS:
        parser.error(f"{LOG_LEVEL_ENV}={level!r} is not a log level; use one of {', '.join(LOG_LEVELS)}")
    if level == "info":
        os.environ.pop(LOG_LEVEL_ENV, None)
    else:
        os.environ[LOG_LEVEL_ENV] = level  # the worker processes' (megarl/terminal.py worker_logging)
    setup_logging(level)
    debug = args.debug or os.environ.get("MEGARL_DEBUG", "") not in ("", "0")
    try:
        return args.handler(args)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except BaseException as exc:  # noqa: BLE001 - every ending gets one clear line and an exit code
        return report(exc, debug)


def report(exc: BaseException, debug: bool = False) -> int:
    """Print how ``exc`` ended the command; returns the exit code."""
    stopped = _stopped_code(exc)
    if stopped is not None:
        error_line(str(exc))
        return stopped
    if isinstance(exc, KeyboardInterrupt):
        error_line("interrupted (Ctrl-C)")
        return EXIT_SIGINT
    if isinstance(exc, SystemExit):
        raise exc
    line = user_error_line(exc)
    if line is None:  # a bug: the whole story
        traceback.print_exception(exc)
        return EXIT_INTERNAL
    log_path = getattr(exc, "megarl_log", None)
    if debug:
        traceback.print_exception(exc)
    error_line(f"error: {line}" + (f"\n(traceback: {log_path})" if log_path and not debug else ""))
    return EXIT_USER


def user_error_line(exc: BaseException) -> str | None:
    """The one-line (or one line per problem) report of a user error; None for anything else."""
    if _is_worker_error(exc) and isinstance(getattr(exc, "cause", None), AssertionError):
        # A broken invariant in a worker, megarl's or Megatron's: a bug (a config mistake is
        # refused before launch), so the whole story. Other exceptions there often come from the
        # user's inputs (a checkpoint of another shape): one line naming the rank and its log.
        return None
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return getattr(exc, "summary", None) or str(exc)
    if isinstance(exc, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)) and exc.filename is None:
        return str(exc)  # raised by megarl with its own message
    if isinstance(exc, ConnectionError):
        return str(exc)
    if type(exc).__module__.startswith("ray."):  # Ray's own failure met in the driver (a full object store, ...)
        from megarl.ray_cluster.ray_failures import ray_failure  # (imports no Ray)

        if line := ray_failure(exc):
            return f"a Ray call of the driver failed: {line}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == "ray" and not _ray_installed():
        return (f"Ray is not installed for {sys.executable}: pip install 'ray[default]' (a megarl dependency), or, for "
                "a layout of one process, add --in-process (megarl launch, sft, convert and generate then run without Ray)")
    if isinstance(exc, OSError) and exc.filename is not None:
        return _os_error_line(exc)
    return _disk_full_line(exc)


def _disk_full_line(exc: BaseException) -> str | None:
    """A full disk that no writer named (a library's write, a worker's): one line all the same."""
    from megarl.disk_full import DiskFullError, disk_full_cause, reason_of

    full = disk_full_cause(exc)
    if full is None:
        return None
    filename = getattr(full, "filename", None)
    where = filename if isinstance(filename, str) and filename else "a file"
    return str(DiskFullError(where, "the command's output", reason_of(full)))


def _ray_installed() -> bool:
    """Whether the ray package is there (without importing it): a missing submodule of an
    installed Ray (one megarl does not match) is a bug to show whole, not "Ray is not installed"."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # a ray module without a spec: there, whatever it is
        return True


def _is_worker_error(exc: BaseException) -> bool:
    cls = getattr(sys.modules.get("megarl.ray_cluster.worker_error"), "WorkerError", None)
    return cls is not None and isinstance(exc, cls)


def _os_error_line(exc: OSError) -> str:
    import errno

    hint = {
        errno.EACCES: "check the permissions or choose another path",
        errno.EPERM: "check the permissions or choose another path",
        errno.EROFS: "the filesystem is read-only: choose a writable path",
        errno.ENOSPC: "the disk is full: free space or choose another disk",
        errno.ENOENT: "check the path",
    }.get(exc.errno or 0, "check the path")
    where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    if exc.strerror and ";" in exc.strerror:  # megarl's own message already says what to do
        return f"{where}: {exc.strerror}"
    return f"{where}: {exc.strerror or exc}; {hint}"


def _stopped_code(exc: BaseException) -> int | None:
    stopped = getattr(sys.modules.get("megarl.trainer.watchdog"), "RunStopped", None)
    if stopped is not None and isinstance(exc, stopped):
        return exc.exit_code
    return None


def _quiet_broken_pipe() -> int:
    """`megarl data inspect x.parquet | head`: the reader left; exit without a traceback."""
    try:
        to_devnull(sys.stdout.fileno())  # Python flushes stdout at exit: make that harmless
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def commands_markdown(width: int = 100) -> str:
    """The commands page of the documentation site: `megarl --help` and every (sub)command's
    --help as argparse prints them at ``width`` columns, built in this process (no subprocess;
    building the parser imports no torch, so the site builds in seconds)."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse's HelpFormatter reads the width from here
    try:
        parser = build_parser()
        out = ["# Commands", "",
               "Generated from megarl's argument parser when the site is built: each block is that command's "
               f"`--help`, exactly as a {width}-column terminal prints it (argparse wraps the text to the terminal's width).",
               "", "## `megarl`", "", "```text",
               parser.format_help().rstrip(), "```", ""]  # fmt: skip
        out += _subcommands_markdown(parser, level=2)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(out)


def _subcommands_markdown(parser: argparse.ArgumentParser, level: int) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                out += [f"{'#' * level} `{command.prog}`", "", "```text", command.format_help().rstrip(), "```", ""]
                out += _subcommands_markdown(command, min(level + 1, 6))
    return out


if __name__ == "__main__":
    sys.exit(main())
