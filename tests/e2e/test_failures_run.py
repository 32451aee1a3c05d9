"""Whole runs ended on purpose, as a user would end them: real `megarl` processes in a launch
directory with relative paths (as the demo's config has).

- Ctrl-C (SIGINT to the terminal's whole process group) stops after the step, saves, prints the
  resume command and exits 130, leaving no process behind;
- SIGKILL of the driver alone: no process of the run survives 10 s (psutil); a SIGTERM to the
  whole process group saves as Ctrl-C does;
- the printed command resumes; metrics.jsonl then reads as one run (each step once);
- `megarl convert` from another directory finds the run's relative model.path, says the
  bit-exact check passed, writes ordinary file modes; `convert CKPT . --overwrite` and a failed
  export destroy nothing and leave no staging folder;
- a reward function that raises on every sample stops the run at step 1 with its traceback; one
  that hangs is stopped by the watchdog, which names the phase and dumps every stack;
- a driver that dies without a word is one `error:` line, exit 2, naming what died first: its
  raylet (killed) or the driver itself (a generate function's os._exit, with Ray or --in-process);
- --in-process runs stop on SIGTERM, Ctrl-C and SIGHUP as before, and a kill -9 after a save
  leaves no process (megatron's save's manager, multiprocessing's resource tracker).
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from run_helpers import steps_logged

from megarl.checkpoint.run_record import MODEL_CONFIG
from megarl.checkpoint.verification import verify_checkpoint
from megarl.commands.demo import prepare_demo

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"
MEGARL = [sys.executable, "-m", "megarl.cli"]
STEPS = 12
RUN_MARK = "MEGARL_TEST_RUN_MARK"  # an environment variable marking one launch's processes


def overrides(steps: int, *extra: str) -> list[str]:
    return ["model.path=demo/model", "data.train_files=[demo/data/train.parquet]", "data.val_files=[demo/data/val.parquet]",
            "trainer.output_dir=run", f"trainer.total_steps={steps}", "trainer.eval_before_train=false",
            f"trainer.eval_freq={steps}", "trainer.save_freq=0", "trainer.loggers=[jsonl]", "data.prompts_per_step=8",
            "rollout.n=4", "actor.mini_batch_size=32", "actor.micro_batch_size=16", *extra]


def start(cwd: Path, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("a") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    proc.wait(timeout=timeout)
    return log.read_text()


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + 600
    while not any(s >= step for s in steps_logged(run)):
        assert proc.poll() is None, f"the run ended before step {step}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no step within 10 minutes"
        time.sleep(0.05)


def survivors(procs: list[psutil.Process], within: float) -> list[str]:
    """Processes of ``procs`` still alive after ``within`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def resume_args(output: str) -> list[str]:
    line = next(ln for ln in output.splitlines() if ln.startswith("resume with: "))
    args = shlex.split(line.removeprefix("resume with: "))
    assert args[:2] == ["megarl", "launch"]
    return MEGARL + args[1:]


@pytest.fixture(scope="module")
def launch_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launch")
    prepare_demo(root / "demo")
    return root


@pytest.fixture(scope="module")
def interrupted(launch_dir):
    """A run stopped with Ctrl-C after its first step."""
    log = launch_dir / "interrupted.log"
    proc = start(launch_dir, [*MEGARL, "launch", str(TINY), *overrides(STEPS)], log)
    wait_for_step(proc, launch_dir / "run", 1, log)
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    output = finish(proc, log, timeout=300)
    return proc.returncode, output, family


def test_ctrl_c_stops_after_the_step_saves_and_says_how_to_resume(interrupted, launch_dir):
    code, output, family = interrupted
    assert code == 130, output[-3000:]
    stopped = [ln for ln in output.splitlines() if ln.startswith("stopped by SIGINT (Ctrl-C) after step ")]
    assert stopped and "saved checkpoint" in stopped[0], output[-3000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 1 <= step < STEPS and steps_logged(launch_dir / "run") == list(range(1, step + 1))
    assert verify_checkpoint(launch_dir / "run" / "checkpoints" / f"step_{step:06d}").step == step
    assert "KeyboardInterrupt" not in output and "Traceback" not in output
    assert not survivors(family, within=10)


@pytest.fixture(scope="module")
def killed(interrupted, launch_dir):
    """The printed resume command, SIGKILLed (the driver alone) after one more step."""
    args = resume_args(interrupted[1])
    log = launch_dir / "killed.log"
    before = max(steps_logged(launch_dir / "run"))
    proc = start(launch_dir, args, log)
    wait_for_step(proc, launch_dir / "run", before + 1, log)
    family = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return args, family, before


def test_sigkill_of_the_driver_leaves_no_process_behind(killed):
    _, family, _ = killed
    names = {p.name() for p in family if p.is_running()} if family else set()
    assert family, "the run had no child processes to check"
    left = survivors(family, within=10)
    assert not left, f"alive 10 s after the driver's SIGKILL: {left} (of {sorted(names)})"


@pytest.fixture(scope="module")
def finished(killed, launch_dir):
    """The printed resume command, run to the end."""
    args, _, _ = killed
    log = launch_dir / "finished.log"
    proc = start(launch_dir, args, log)
    output = finish(proc, log)
    return args, proc.returncode, output


def test_the_resume_command_finishes_the_run_as_one(finished, launch_dir):
    args, code, output = finished
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert steps_logged(launch_dir / "run") == list(range(1, STEPS + 1))  # appended, cut back: each step once
    # Running it once more: nothing to do, said before Ray starts.
    again = subprocess.run(args, cwd=launch_dir, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already finished" in again.stdout and "embedded Ray" not in again.stderr


def test_convert_from_elsewhere_and_what_it_refuses(finished, launch_dir, tmp_path):
    ckpt = launch_dir / "run" / "checkpoints" / f"step_{STEPS:06d}"
    assert ckpt.is_dir(), "the run did not finish"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([*MEGARL, "convert", str(ckpt), "hf"], cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bit for bit" in done.stdout and "verified:" in done.stdout
    hf = elsewhere / "hf"
    assert (hf / "megarl_export.json").is_file() and (hf / "config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in hf.iterdir()} == {0o666 & ~umask}
    assert not [p.name for p in elsewhere.iterdir() if "staging" in p.name]
    # `convert CKPT . --overwrite` in a directory of one's own: refused before Ray, nothing lost.
    (elsewhere / "precious.txt").write_text("mine")
    dot = subprocess.run([*MEGARL, "convert", str(ckpt), ".", "--overwrite"], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300)
    assert dot.returncode == 2 and dot.stderr.startswith("error: ") and "is the current directory" in dot.stderr
    assert "the ranks' logs" not in dot.stderr and (elsewhere / "precious.txt").read_text() == "mine"  # no Ray, no rank
    assert (hf / "megarl_export.json").is_file()


def test_a_failed_export_leaves_no_staging_and_one_line(finished, launch_dir, tmp_path):
    # A checkpoint of an earlier megarl (no copy of model.path's config.json, which would refuse
    # the edit below before Ray starts), so that the export fails in the ranks.
    ckpt = tmp_path / "older" / f"step_{STEPS:06d}"
    shutil.copytree(launch_dir / "run" / "checkpoints" / ckpt.name, ckpt)
    (ckpt / MODEL_CONFIG).unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["components"].remove(MODEL_CONFIG)
    manifest["files"] = [f for f in manifest["files"] if f["path"] != MODEL_CONFIG]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    # The run's config with a model of another shape: the checkpoint cannot load into it.
    bigger = tmp_path / "bigger"
    prepare_demo(bigger)
    cfg_json = json.loads((bigger / "model" / "config.json").read_text())
    cfg_json["intermediate_size"] *= 2
    (bigger / "model" / "config.json").write_text(json.dumps(cfg_json))
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"]["path"] = str(bigger / "model")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out" / "hf"
    proc = subprocess.run([*MEGARL, "convert", str(ckpt), str(out), "--config", str(tmp_path / "run.yaml")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "policy rank" in errors[0] and "(log: " in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # nothing staged is left, nor the folder the command made for OUT (and its lock)
    assert not out.exists() and (not out.parent.exists() or not [p.name for p in out.parent.iterdir() if "staging" in p.name])


def test_a_sigterm_to_the_group_while_converting_exits_143_and_writes_nothing(finished, launch_dir, tmp_path):
    """`timeout` / `kill -TERM -PGID` on a convert while its ranks load: one line, exit 143, no OUT and
    no staging folder beside it, no process of it left (Ray's own SIGTERM handling exited 1, without a line)."""
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    log = tmp_path / "convert.log"
    mark = f"{os.getpid()}-{time.time_ns()}"
    ckpt = launch_dir / "run" / "checkpoints" / f"step_{STEPS:06d}"
    proc = start(launch_dir, [*MEGARL, "convert", str(ckpt), str(out)], log, env={**os.environ, RUN_MARK: mark})
    deadline = time.monotonic() + 120
    while "building ExportRank" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    output = finish(proc, log, timeout=120)
    assert proc.returncode == 143, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("stopped by SIGTERM while converting; OUT is as it was"), output[-3000:]
    assert list(out.parent.iterdir()) == []
    assert survivors(_run_processes(mark), within=10) == []


REWARDS = """
import time

def raises(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0}["typo"]

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)
"""


def test_a_reward_that_raises_everywhere_stops_at_step_one(launch_dir, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    run = tmp_path / "raising"
    args = [*MEGARL, "launch", str(TINY), *overrides(3, f"reward.custom.path={tmp_path / 'rewards.py'}",
                                                     "reward.custom.name=raises", f"trainer.output_dir={run}")]
    proc = subprocess.run(args, cwd=launch_dir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr[proc.stderr.index("error: "):]
    assert err.startswith("error: reward.custom 'raises' (rewards.py) failed on 32 of 32 samples (32 errors, 0 timeouts)")
    assert "KeyError: 'typo'" in err and 'return {"score": 1.0}["typo"]' in err  # the function's own traceback
    assert steps_logged(run) == [] and (run / "logs" / "driver.log").is_file()


def test_a_hanging_phase_is_stopped_by_the_watchdog(launch_dir, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    run = tmp_path / "hanging"
    args = [*MEGARL, "launch", str(TINY), *overrides(3, f"reward.custom.path={tmp_path / 'rewards.py'}", "reward.custom.name=hangs",
                                                     "reward.timeout_s=600", "trainer.hang_timeout_s=8",
                                                     f"trainer.output_dir={run}")]
    proc = subprocess.run(args, cwd=launch_dir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error: "))
    assert "no progress for" in line and "in phase 'reward' of step 1" in line and "trainer.hang_timeout_s=8" in line
    assert "most recent call first" in (run / "logs" / "driver_stacks.log").read_text()
    assert "most recent call first" in (run / "logs" / "policy_rank0.log").read_text()


def test_sigterm_while_ray_starts_exits_143_with_nothing_left(launch_dir, tmp_path):
    """SIGTERM (Slurm's stop) to the driver while the embedded Ray starts: ray.init's own handler
    would exit 15 at once; megarl's takes it: exit 143, "while starting", no process left behind."""
    proc, log, _, mark = _launch_marked(launch_dir, tmp_path, "starting", steps=3)
    deadline = time.monotonic() + 120
    while "starting an embedded Ray" not in log.read_text() or not [p for p in _run_processes(mark) if p.pid != proc.pid]:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]  # (Ray's first process seen)
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc, log, timeout=120)
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM while starting; nothing was trained or saved" in output
    # the run's processes (Ray's GCS, raylet, workers), wherever they were re-parented
    assert survivors(_run_processes(mark), within=10) == []


def test_a_second_launch_into_a_running_runs_output_dir_is_refused(launch_dir, tmp_path):
    """The same command again while the run lives (a Slurm requeue of a job still running):
    refused before it touches the run, naming the first; the first goes on undisturbed. Then
    a SIGTERM to the first one's whole process group (what `timeout` and `kill -TERM -PGID`
    send) reaches the driver, not the embedded Ray's processes or the reward workers, which hold
    the run's state: it saves as on Ctrl-C, and no process is left."""
    proc, log, args, mark = _launch_marked(launch_dir, tmp_path, "busy")
    try:
        wait_for_step(proc, launch_dir / "busy", 1, log)
        second = subprocess.run(args, cwd=launch_dir, capture_output=True, text=True, timeout=120)
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        output = finish(proc, log, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert re.search(rf"^error: trainer.output_dir busy is in use by pid {proc.pid} on \S+ \(since [^)]*\); wait for that "
                     r"run to end or stop it \(.*\), or give another trainer.output_dir$", second.stderr, re.M), second.stderr[-3000:]
    assert proc.returncode == 143 and "saved checkpoint" in output, output[-3000:]
    steps = steps_logged(launch_dir / "busy")
    assert steps == list(range(1, max(steps) + 1))  # one run's lines, none cut by the refused launch
    assert verify_checkpoint(launch_dir / "busy" / "checkpoints" / f"step_{max(steps):06d}").step == max(steps)
    assert survivors(_run_processes(mark), within=10) == []


def _launch_marked(launch_dir: Path, tmp_path: Path, name: str, steps: int = 1000) -> tuple[subprocess.Popen, Path, list[str], str]:
    """`megarl launch` of TINY into output_dir ``name`` (its output in tmp_path/NAME.log), every
    process it starts (Ray's too, by no other) marked for :func:`_run_processes`: the process, the
    log, the command and the mark."""
    log = tmp_path / f"{name}.log"
    args = [*MEGARL, "launch", str(TINY), *overrides(steps, f"trainer.output_dir={name}")]
    mark = f"{os.getpid()}-{time.time_ns()}"
    return start(launch_dir, args, log, env={**os.environ, RUN_MARK: mark}), log, args, mark


def _run_processes(mark: str) -> list[psutil.Process]:
    """The processes of the run started with ``mark`` in its environment, wherever they were
    re-parented (another run's Ray on the machine has none)."""
    return [p for p in psutil.process_iter() if _marked(p, mark)]


def _marked(p: psutil.Process, mark: str) -> bool:
    try:
        return p.environ().get(RUN_MARK) == mark
    except psutil.Error:  # gone, or not ours to read
        return False


def test_a_closed_terminal_saves_and_exits_129(launch_dir, tmp_path):
    """The run's terminal goes away (a closed window, a dropped ssh connection): the kernel sends
    SIGHUP to the session's leader, the shell sends it to its jobs' whole process groups, and every
    later write to the terminal fails. The driver stops after the step and saves as on SIGTERM, its
    end in logs/driver.log; the embedded Ray's processes and the reward workers, in that group, do
    not die under it."""
    import pty

    master, slave = pty.openpty()
    tty = os.ttyname(slave)
    mark = f"{os.getpid()}-{time.time_ns()}"
    args = [*MEGARL, "launch", str(TINY), *overrides(1000, "trainer.output_dir=hangup")]
    # its own session whose controlling terminal is the pty (opening it there makes it so)
    proc = subprocess.Popen(args, cwd=launch_dir, env={**os.environ, RUN_MARK: mark}, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True, preexec_fn=lambda: os.close(os.open(tty, os.O_RDWR)))
    os.close(slave)
    seen = bytearray()
    try:
        deadline = time.monotonic() + 600
        while not steps_logged(launch_dir / "hangup"):
            assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
            if select.select([master], [], [], 0.05)[0]:
                seen += os.read(master, 65536)  # (a full terminal would block the run)
    finally:
        os.close(master)  # the hangup: the kernel's SIGHUP to the session leader (the driver here)
        os.killpg(proc.pid, signal.SIGHUP)  # the shell's to its job's process group
    proc.wait(timeout=300)
    driver_log = (launch_dir / "hangup" / "logs" / "driver.log").read_text()
    assert proc.returncode == 129, driver_log[-3000:]
    stopped = re.search(r"stopped by SIGHUP \(terminal closed\) after step (\d+); saved checkpoint", driver_log)
    assert stopped and "resume with: megarl launch" in driver_log, driver_log[-3000:]
    step = int(stopped.group(1))
    assert steps_logged(launch_dir / "hangup") == list(range(1, step + 1))
    assert verify_checkpoint(launch_dir / "hangup" / "checkpoints" / f"step_{step:06d}").step == step
    # the reward workers and multiprocessing's resource tracker lived
    assert "pool broke" not in driver_log and "died unexpectedly" not in driver_log, driver_log[-3000:]
    assert survivors(_run_processes(mark), within=10) == []


def test_a_raylet_killed_under_the_run_is_one_line_naming_the_node(launch_dir, tmp_path):
    """Ray's core worker ends a driver whose raylet died, in C (no Python handler runs: exit 1 and
    Ray's state dump); `megarl launch` watches its driver from outside and says it in one line:
    the node, the raylet's log, the resume command. Which comes first is a race: the quick exit, or
    a rank's failed call that the driver reports itself (naming the node's death as well). Either
    way: one `error:` line naming the dead node, exit code 2, no process of the run left."""
    proc, log, _, mark = _launch_marked(launch_dir, tmp_path, "raylet")
    try:
        wait_for_step(proc, launch_dir / "raylet", 1, log)
        (raylet,) = [p for p in _run_processes(mark) if p.name() == "raylet"]
        raylet.kill()
        output = finish(proc, log, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    if errors[0].startswith("error: the Ray node under the run died: node "):  # the supervisor's line
        assert "/raylet.out and raylet.err" in errors[0] and "resume with: megarl launch" in errors[0], errors[0]
    else:  # the driver's own
        assert re.search(r"its node \S+ \(id \w+\) died \(its raylet does not answer|Ray marked it dead", errors[0]), errors[0]
    assert survivors(_run_processes(mark), within=10) == []


IN_PROCESS = ("--in-process", "cluster.nnodes=1", "cluster.gpus_per_node=1", "rollout.engine=torch")


def _oexit_launch(launch_dir: Path, tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """`megarl launch` of the tiny run whose generate function calls os._exit(0): the process, its
    output and the run's mark (for its processes)."""
    (tmp_path / "gfx.py").write_text("import os\n\ndef g_oexit(engines, prompts, params):\n    os._exit(0)\n")
    mark = f"{os.getpid()}-{time.time_ns()}"
    args = [*MEGARL, "launch", str(TINY), *extra, *overrides(2, f"trainer.output_dir={name}", "rollout.generate_function=gfx:g_oexit")]
    env = {**os.environ, RUN_MARK: mark, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    log = tmp_path / f"{name}.log"
    proc = start(launch_dir, args, log, env=env)
    try:
        output = finish(proc, log, timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, output, mark


def test_an_in_process_driver_that_calls_os_exit_is_one_line_and_exit_2(launch_dir, tmp_path):
    """A generate function's os._exit(0) under --in-process: no success (0) and no silence, but
    the supervisor's one line naming the driver's own death, with its log and the resume command."""
    proc, output, _ = _oexit_launch(launch_dir, tmp_path, "oexit", *IN_PROCESS)
    assert proc.returncode == 2, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "exited with code 0 without reporting an error: user code in the driver" in errors[0], output[-3000:]
    assert "oexit/logs/driver.log" in errors[0] and "resume with: megarl launch" in errors[0], errors[0]


def test_sigkill_of_an_in_process_launch_after_a_save_leaves_no_process(launch_dir, tmp_path):
    """kill -9 of `megarl launch --in-process` once a checkpoint is written: the driver child dies
    with it, and so do megatron's save's manager process and multiprocessing's resource tracker."""
    log = tmp_path / "saved.log"
    mark = f"{os.getpid()}-{time.time_ns()}"
    args = [*MEGARL, "launch", str(TINY), *IN_PROCESS, *overrides(1000, "trainer.output_dir=saved", "trainer.save_freq=1")]
    proc = start(launch_dir, args, log, env={**os.environ, RUN_MARK: mark})
    try:
        deadline = time.monotonic() + 600
        while not (launch_dir / "saved" / "checkpoints" / "step_000001").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # the save's processes are up
        family = _run_processes(mark)
        assert any("multiprocessing" in " ".join(p.cmdline()) for p in family), [p.cmdline() for p in family]
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = survivors(_run_processes(mark), within=10)
    for p in _run_processes(mark):  # no orphan outlives a failure here (a resource tracker ignores SIGTERM)
        p.kill()
    assert left == []


def test_a_driver_that_calls_os_exit_under_ray_is_blamed_not_its_node(launch_dir, tmp_path):
    """A generate function's os._exit(0) in a driver with an embedded Ray: the raylet dies with the
    driver, but the supervisor saw it alive while the driver ran: the driver's own death is named."""
    proc, output, mark = _oexit_launch(launch_dir, tmp_path, "ray_oexit")
    assert proc.returncode == 2, output[-3000:]
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the driver process (pid "), output[-3000:]
    assert "exited with code 0 without reporting an error" in errors[0] and "Ray node" not in errors[0], errors[0]
    assert survivors(_run_processes(mark), within=10) == []


@pytest.mark.parametrize(("signum", "code", "said"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT (Ctrl-C)"),
                                                     (signal.SIGHUP, 129, "SIGHUP (terminal closed)")])
def test_an_in_process_launch_stops_on_signals_as_before(launch_dir, tmp_path, signum, code, said):
    """--in-process under the supervisor: a SIGTERM or SIGHUP to the `megarl launch` process (passed on) or
    a Ctrl-C to the group (not doubled) stops after the step, saves, and exits 143 / 130 / 129."""
    out = f"in_process_{signum}"
    log = tmp_path / "stop.log"
    mark = f"{os.getpid()}-{time.time_ns()}"
    proc = start(launch_dir, [*MEGARL, "launch", str(TINY), *IN_PROCESS, *overrides(1000, f"trainer.output_dir={out}")],
                 log, env={**os.environ, RUN_MARK: mark})  # fmt: skip
    try:
        wait_for_step(proc, launch_dir / out, 1, log)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # what a terminal does
        else:
            proc.send_signal(signum)
        output = finish(proc, log, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, output[-3000:]
    assert re.search(rf"stopped by {re.escape(said)} after step \d+; saved checkpoint", output), output[-3000:]
    assert "error:" not in output and "Traceback" not in output, output[-3000:]
    assert survivors(_run_processes(mark), within=10) == []
