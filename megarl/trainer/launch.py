"""A run from its config to its end, in the driver: load and plan the config (every check before
Ray starts), refuse a finished run, start Ray (embedded or attached) or run in this process, build
the trainer and fit, with the driver's log file, one run per output_dir and clean stops
(megarl/trainer/watchdog.py). `megarl launch`, `megarl demo` and the batch scripts of
`megarl sbatch` run it; `megarl sft` shares the driver's log and the one-machine check.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from megarl.checkpoint.manager import CheckpointManager
from megarl.config.loading import load_config
from megarl.config.sections import MegaRLConfig
from megarl.plan.planner import Plan, make_plan
from megarl.progress import still_waiting
from megarl.ray_cluster.worker_error import WorkerError
from megarl.terminal import LogFileHandler, library_warnings_logged
from megarl.user_code import user_output_to

log = logging.getLogger(__name__)
DRIVER_LOG = "driver.log"
USER_CODE_LOG = "user_code.log"  # what your tools, interactions, dataset class, generate function print
RESUME_ENV = "MEGARL_RESUME_COMMAND"  # overrides the printed resume command (set by megarl sbatch scripts)


def launch(config: str | Path, overrides: list[str], address: str | None = None,
           resume_command: str | None = None, *, in_process: bool = False) -> dict[str, float]:
    """Run the config to the end; returns the last step's metrics ({} when there was nothing to do)."""
    from megarl.plan.resume_checks import finished_run

    cfg = load_config(config, overrides)
    from megarl.trainer.watchdog import run_stoppable

    # a Ctrl-C, SIGTERM or SIGHUP while the checks import user code: one line, the check's child killed
    with still_waiting("checking the config and its files"):  # imports, the files' and the machine's checks
        plan = run_stoppable(lambda: launch_plan(cfg, address, in_process=in_process),
                             "while checking the config and its files; nothing was started")
    for warning in plan.warnings:
        log.warning("%s", warning)
    for key, value in plan.resolved.items():
        log.info("%s: auto -> %s (the plan's choice)", key, value)
    finished = finished_run(cfg)
    if finished:
        print(finished)
        return {}
    # A batch script (launch/megarl.sbatch) names itself: resubmitting is how its runs resume.
    command = resume_command or os.environ.get(RESUME_ENV) or launch_command(config, overrides, cfg, address, in_process)
    from megarl.driver_supervisor import report

    report(resume=command, log=str(Path(cfg.trainer.output_dir) / "logs" / DRIVER_LOG))  # for the supervisor's line should this process end without a word
    return run(cfg, plan, address, command, in_process=in_process)


def launch_plan(cfg: MegaRLConfig, address: str | None, *, in_process: bool = False, sft: bool = False) -> Plan:
    """The plan of a launch: the planner's checks (with the files', but for `megarl sft`, which
    checks its own) and the machine's (megarl/plan/machine_checks.py), every problem in one
    PlanError. ``in_process``: no Ray, so no machine check (the plan checks a world of one)."""
    from megarl.plan.issues import PlanError
    from megarl.plan.machine_checks import machine_issues

    machine = [] if in_process else machine_issues(cfg, address)
    try:
        plan = make_plan(cfg, check_files=not sft, in_process=in_process, sft=sft)
    except PlanError as exc:
        raise PlanError(machine + exc.issues, exc.warnings) from None
    if machine:
        raise PlanError(machine, plan.warnings)
    return plan


def launch_command(config: str | Path, overrides: list[str], cfg: MegaRLConfig, address: str | None = None,
                   in_process: bool = False) -> str:  # fmt: skip
    """The `megarl launch` command line that resumes this run (trainer.resume=auto)."""
    args = ["megarl", "launch", str(config), *(o for o in overrides if not o.startswith("trainer.resume="))]
    if address:
        args += ["--address", address]
    if in_process:
        args.append("--in-process")
    if cfg.trainer.resume != "auto":
        args.append("trainer.resume=auto")
    return shlex.join(args)


def run(cfg: MegaRLConfig, plan, address: str | None = None, resume_command: str = "", *,
        in_process: bool = False) -> dict[str, float]:  # fmt: skip
    from megarl.trainer.build import build_trainer, shutdown
    from megarl.trainer.run_lock import output_dir_lock
    from megarl.trainer.watchdog import RunControl

    address = address or cfg.cluster.ray_address
    local_cpus = None if address else max(os.cpu_count() or 1, _cpus_needed(plan))
    control = RunControl(resume_command, save_on_signal=cfg.trainer.checkpoint_on_signal)
    trainer = None
    with (
        output_dir_lock(cfg.trainer.output_dir),  # one run per output_dir: a second launch there is refused
        driver_log(Path(cfg.trainer.output_dir) / "logs" / DRIVER_LOG),
        user_output_to(Path(cfg.trainer.output_dir) / "logs" / USER_CODE_LOG, cfg.reward.output_log_max_mb),  # tools', interactions', ... prints
        control.handlers(),
    ):
        where = "this process" if in_process else f"Ray at {address}" if address else f"an embedded Ray ({local_cpus} CPUs)"
        log.info("starting %s, then %s", where, _roles(plan))
        stopped = lambda: control.stopped(f"stopped by {control.signal_name} while starting{control.meanwhile}; nothing was "  # noqa: E731
                                          f"trained or saved\nstart again with: {resume_command or 'the same command'}")
        with ExitStack() as session:
            control.enter_starting(session, _session(in_process, address, local_cpus, cfg), stopped)
            try:
                trainer = build_trainer(cfg, plan, in_process=in_process)
                return trainer.fit(control)  # stops in the step loop are its own (RunStopped)
            except KeyboardInterrupt:  # Ctrl-C / SIGTERM while starting (workers, restore): nothing to save
                raise stopped() from None
            except WorkerError as exc:
                if trainer is not None:  # mid-run: what is kept and how to go on, as the run's other endings say
                    add_kept_and_resume(exc, trainer.checkpoints, resume_command)
                raise
            finally:
                control.cleaning = True  # signals from here on wait for the shutdown
                shutdown(trainer)
                if cfg.trainer.profile_steps and not in_process:
                    from megarl.ray_cluster.session import save_timeline

                    save_timeline(Path(cfg.trainer.output_dir) / "profile" / "ray_timeline.json")


def add_kept_and_resume(exc: WorkerError, checkpoints: CheckpointManager, command: str) -> None:
    """A rank's failure mid-run (a rank killed, its node's death) ends the run's one line with the
    last complete checkpoint and the command that resumes (``command``), as a stop or a full disk
    does: the rank's own line knows neither."""
    latest = checkpoints.latest_valid(quiet=True)
    kept = f"last checkpoint: step {latest.step} ({latest.path})" if latest else "no checkpoint yet (it starts again at step 0)"
    exc.summary = f"{exc.summary}; {kept}; resume with: {command or 'the same command (trainer.resume=auto)'}"


@contextmanager
def _session(in_process: bool, address: str | None, local_cpus: int | None, cfg: MegaRLConfig) -> Iterator[None]:
    """Ray (embedded or attached), or nothing for a run in this process."""
    if in_process:
        yield
        return
    from megarl.ray_cluster.session import ray_session

    with ray_session(address, num_cpus=local_cpus, num_gpus=None if address else _local_gpus(cfg)):
        yield


@contextmanager
def driver_log(path: Path) -> Iterator[None]:
    """Everything the driver logs also goes to ``path``, plus the traceback of what ends the run
    (the terminal gets one line: megarl/cli.py)."""
    from megarl.driver_supervisor import report

    path.parent.mkdir(parents=True, exist_ok=True)
    report(log=str(path))  # what the supervisor's line names should this process end without a word (`megarl sft`'s too)
    handler = LogFileHandler(path)  # a full disk silences it: no "--- Logging error ---" per record
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    root, errors = logging.getLogger(), logging.getLogger("megarl.driver_errors")
    errors.propagate = False  # tracebacks to the file only
    root.addHandler(handler)
    errors.addHandler(handler)
    try:
        with library_warnings_logged():  # installed packages' warnings (Megatron's, torch's) to the file only
            yield
    except BaseException as exc:
        errors.error("the run ended with %s", type(exc).__name__, exc_info=exc)
        try:
            if handler.failed is None:  # else the traceback is not there to point at
                exc.megarl_log = str(path)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        raise
    finally:
        root.removeHandler(handler)
        errors.removeHandler(handler)
        handler.close()


def _roles(plan) -> str:
    return ", ".join(f"{len(r.gpus)} {r.role} rank(s)" for r in _ray_roles(plan))


def _cpus_needed(plan) -> int:
    """One logical CPU per process of each role (colocated roles share bundles but add CPUs),
    the reward model's actors included."""
    return sum(len(r.gpus) for r in _ray_roles(plan)) + 1


def _ray_roles(plan) -> list:
    """The roles whose processes ask Ray for a CPU each: the trained models' ranks and the reward model's actors."""
    return [r for name, r in plan.roles.items() if name != "rollout"] + ([plan.reward_model] if plan.reward_model else [])


def _local_gpus(cfg: MegaRLConfig) -> int | None:
    return cfg.cluster.gpus_per_node if cfg.cluster.device == "cuda" else None
