"""`megarl sbatch` scripts under a real Slurm: a single-node cluster (munged, slurmctld, slurmd
from Debian's slurm-wlm, private config, sockets and ports) started by this module.

- a 2-step tiny CPU run: the job starts Ray, trains, saves and exits 0;
- a node whose `ray start` fails: the job ends at once with the end of that node's Ray log;
- `scancel --signal=TERM` mid-run (a script written to stdout): the job finishes the step, saves a
  checkpoint, exits 143 and names `sbatch SCRIPT` as the way to resume;
  submitting the same script again resumes at that step (metrics.jsonl reads as one run).

Skipped with the reason where Slurm is not installed (`.ci/run` installs it: ci/slurm/install.sh)
or the test is not root (slurmd runs jobs as root here).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import steps_logged

from megarl.commands.demo import prepare_demo

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MEGARL = str(Path(sys.executable).parent / "megarl")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_conf(d: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=megarltest", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge", f"AuthInfo=socket={d}/munge/sock", "CredType=cred/munge", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SlurmUser=root",
        "SlurmdUser=root", "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "KillWait=10", "MinJobAge=3600",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid", f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool", f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log",
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", "",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running single-node cluster; every daemon is stopped afterwards."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test's slurmd runs jobs as root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(mode=0o700)
    subprocess.run(["mungekey", "--create", f"--keyfile={d}/munge/key"], check=True)
    subprocess.run(["munged", "--force", f"--socket={d}/munge/sock", f"--key-file={d}/munge/key", f"--log-file={d}/munge/log",
                    f"--pid-file={d}/munge/pid", f"--seed-file={d}/munge/seed"], check=True)  # fmt: skip
    (d / "slurm.conf").write_text(_slurm_conf(d, socket.gethostname().split(".")[0]))
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    try:
        subprocess.run(["slurmctld"], env=env, check=True)
        subprocess.run(["slurmd"], env=env, check=True)
        _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout,
              60, "the node to become idle")  # fmt: skip
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--partition=debug"], env=env, capture_output=True)
        for pid_file in (d / "slurmd.pid", d / "slurmctld.pid", d / "munge" / "pid"):
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def _wait(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(1)


@pytest.fixture(scope="module")
def launch_dir(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("launch")
    prepare_demo(cwd / "demo")
    return cwd


def write_script(cwd: Path, out: str, steps: int, name: str, stdout: bool = False) -> Path:
    """`megarl sbatch ... --out NAME`, or with ``stdout`` `megarl sbatch ... > NAME`."""
    overrides = ["model.path=demo/model", "data.train_files=[demo/data/train.parquet]", "data.val_files=[demo/data/val.parquet]",
                 f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.eval_before_train=false",
                 f"trainer.eval_freq={steps}", "trainer.save_freq=0", "trainer.loggers=[jsonl]", "data.prompts_per_step=8",
                 "rollout.n=4", "actor.mini_batch_size=32", "actor.micro_batch_size=16"]  # fmt: skip
    done = subprocess.run([MEGARL, "sbatch", str(ROOT / "configs" / "tiny_grpo.yaml"), *overrides, "--partition", "debug", "--time", "30",
                    "--save-grace", "60", "--join-timeout", "120", "--ray-port", str(_free_port()), *([] if stdout else ["--out", name])],
                   cwd=cwd, check=True, capture_output=True, text=True)  # fmt: skip
    if stdout:
        (cwd / name).write_text(done.stdout)
    return cwd / name


def submit(env: dict, script: Path) -> str:
    return subprocess.run(["sbatch", "--parsable", str(script)], env=env, cwd=script.parent, check=True,
                          capture_output=True, text=True).stdout.strip().split(";")[0]  # fmt: skip


def job_field(env: dict, job: str, field: str) -> str:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in text.split() if w.startswith(f"{field}=")), "")


def wait_done(env: dict, job: str, timeout_s: float = 420) -> str:
    """The job's exit code once it has ended (scontrol's ExitCode, e.g. '0:0')."""
    _wait(lambda: job_field(env, job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
          timeout_s, f"job {job} to end")  # fmt: skip
    return job_field(env, job, "ExitCode")


def test_a_two_step_run_exits_zero(slurm, launch_dir):
    script = write_script(launch_dir, "run_ok", 2, "ok.sbatch")
    job = submit(slurm, script)
    code = wait_done(slurm, job)
    log = (launch_dir / "run_ok" / "logs" / "slurm" / f"slurm-{job}.out").read_text()
    assert code == "0:0", log
    assert "ray-node: 1 node(s) joined" in log and "megarl launch exited with code 0" in log
    assert steps_logged(launch_dir / "run_ok") == [1, 2]
    assert (launch_dir / "run_ok" / "checkpoints" / "step_000002").is_dir()


def test_a_node_whose_ray_fails_to_start_ends_the_job_at_once(slurm, launch_dir):
    """Not after --join-timeout (120 s here): the job says which node and shows its Ray log's end."""
    script = write_script(launch_dir, "run_bad_ray", 2, "bad_ray.sbatch")
    job = submit({**slurm, "MEGARL_RAY_START_ARGS": "--num-cpus=two"}, script)  # sbatch passes the environment on
    code = wait_done(slurm, job)
    log = (launch_dir / "run_bad_ray" / "logs" / "slurm" / f"slurm-{job}.out").read_text()
    assert code == "1:0", log
    assert f"megarl-sbatch: Ray did not start on {socket.gethostname().split('.')[0]}" in log, log
    assert "'two' is not a valid integer" in log and "did not answer" not in log and "no Ray head answers" not in log


def test_term_saves_at_a_safe_point_and_resubmitting_resumes(slurm, launch_dir):
    run = launch_dir / "run_term"
    script = write_script(launch_dir, "run_term", 40, "term.sbatch", stdout=True)  # `> FILE`: Slurm names the file
    job = submit(slurm, script)
    _wait(lambda: len(steps_logged(run)) >= 2, 300, "two steps")
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True)
    code = wait_done(slurm, job)
    log = (run / "logs" / "slurm" / f"slurm-{job}.out").read_text()
    stopped_at = steps_logged(run)[-1]
    assert code == "143:0", log
    assert f"stopped by SIGTERM after step {stopped_at}; saved checkpoint" in log
    assert f"resume with: sbatch {script}" in log  # the script resumes itself
    assert (run / "checkpoints" / f"step_{stopped_at:06d}").is_dir() and stopped_at < 40

    again = submit(slurm, script)  # the same script: trainer.resume=auto
    assert wait_done(slurm, again) == "0:0"
    resumed = (run / "logs" / "slurm" / f"slurm-{again}.out").read_text()
    assert f"step_{stopped_at:06d}" in resumed
    assert steps_logged(run) == list(range(1, 41))  # each step once: resumed exactly where it stopped
