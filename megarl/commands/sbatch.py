"""`megarl sbatch CONFIG [k=v ...] --partition P --time T`: a Slurm batch script for the config.

The script is launch/megarl.sbatch with its blanks filled from the config (nodes, GPUs per
node) and the options, and launch/ray-node.sh (the Ray node bootstrap) embedded, so the one
file is all a Slurm user submits. The config is checked by the planner first: a script is only
written for a run that can start. The templates live in the checkout's launch/ folder (megarl
is installed from a checkout, `pip install -e`, on clusters and in docker/'s images).
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from pathlib import Path

from megarl.commands.arguments import add_config_args, user_path

LAUNCH_DIR = Path(__file__).resolve().parents[2] / "launch"
TEMPLATE, BOOTSTRAP = "megarl.sbatch", "ray-node.sh"
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; and no limit: 0, -1, INFINITE, UNLIMITED
# pyxis's container name for every step of a job (expanded by the batch shell: one per job).
CONTAINER_NAME = "megarl-${SLURM_JOB_ID}"
DEFAULTS = {"ray_port": 6379, "join_timeout": 600, "save_grace": 600}  # options with a default value
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_NO_LIMIT = ("-1", "infinite", "unlimited")  # sbatch reads the words in any case; a limit of 0 is none too
# The ports `ray start --head` takes for itself by default (client server, dashboard, dashboard agent,
# worker processes 10002-19999): a head port among them makes `ray start` fail at once.
RAY_DEFAULT_PORTS = {"the client server": range(10001, 10002), "the dashboard": range(8265, 8266),
                     "the dashboard agent": range(52365, 52366), "worker processes": range(10002, 20000)}  # fmt: skip


class SbatchError(ValueError):
    """An option of `megarl sbatch` that cannot make a working script."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sbatch",
        help="write a Slurm batch script that runs the config on cluster.nnodes x cluster.gpus_per_node",
        description="Check the config, then write a complete sbatch script: exclusive nodes with the config's GPUs, "
        "the Ray head on the first node and a Ray worker on each other node (job steps), a wait until every node "
        "joined, then `megarl launch CONFIG --address HEAD:PORT trainer.resume=auto` on the head. "
        "`scancel --batch --signal=TERM JOBID` and the time limit stop the run at a safe point with a checkpoint; "
        "resubmitting resumes. Logs go to <trainer.output_dir>/logs/slurm/.",
        epilog="example:\n  megarl sbatch configs/qwen72b_grpo.yaml --partition gpu --time 2-00:00:00 --out qwen72b.sbatch\n"
        "  sbatch qwen72b.sbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--partition", required=True, help="Slurm partition (sbatch --partition)")
    # Stripped: sbatch refuses `--time= 30` (a value pasted with a space) that megarl would accept.
    p.add_argument("--time", required=True, type=str.strip, help="time limit in Slurm's format: MINUTES, HH:MM:SS or D-HH:MM:SS; 0 or "
                   "UNLIMITED for none (the partition's limit then applies)")
    p.add_argument("--account", help="Slurm account to charge (sbatch --account)")
    p.add_argument("--container", metavar="IMAGE", help="run every step in this image (pyxis/enroot: srun --container-image)")
    p.add_argument("--container-mounts", metavar="SRC:DST,...", help="extra container mounts (the working directory is always mounted)")
    p.add_argument("--job-name", help="Slurm job name (default: megarl-<config name>)")
    p.add_argument("--ray-port", type=int, default=DEFAULTS["ray_port"], help="the Ray head's port, not one Ray keeps for itself: 8265, 10001-19999, 52365 (default: %(default)s)")
    p.add_argument("--join-timeout", type=int, default=DEFAULTS["join_timeout"], metavar="S",
                   help="seconds to wait for every node to join Ray before failing (default: %(default)s)")  # fmt: skip
    p.add_argument("--save-grace", type=int, default=DEFAULTS["save_grace"], metavar="S",
                   help="seconds before the time limit at which the run stops and saves (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", type=user_path, metavar="FILE", help="write the script here (default: print it)")
    p.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan

    cfg = load_config(args.config, args.overrides)
    if cfg.trainer.resume not in ("auto", "disable"):
        raise SbatchError(f"trainer.resume ({cfg.trainer.resume}): batch scripts resume with auto, so each resubmission continues "
                          "the run; copy that checkpoint into trainer.output_dir/checkpoints, or use trainer.resume=auto")  # fmt: skip
    make_plan(cfg)  # refuses a run that cannot start, before anything is written
    script = render(cfg, args)
    _warn_missing_here(cfg, Path.cwd())
    if args.out is None:
        sys.stdout.write(script)
        return 0
    write_script(Path(args.out), script, args.overwrite)
    gpus = f"{cfg.cluster.gpus_per_node} GPU(s)" if cfg.cluster.device == "cuda" else "CPU"
    print(f"wrote {args.out}: {cfg.cluster.nnodes} node(s) x {gpus}, partition {args.partition}, time {args.time}\n"
          f"submit with: sbatch {shlex.quote(args.out)}")  # fmt: skip
    return 0


def render(cfg, args: argparse.Namespace, workdir: Path | None = None) -> str:
    """The batch script for ``cfg`` (checked) and the command-line options ``args``."""
    from megarl import __version__
    from megarl.trainer.launch import RESUME_ENV, launch_command

    check_options(args)
    workdir = (workdir or Path.cwd()).resolve()
    log_dir = (workdir / cfg.trainer.output_dir / "logs" / "slurm").resolve()
    if re.search(r"[\s'\"%]", str(log_dir)):  # #SBATCH lines take no quoting; % is Slurm's pattern sign
        raise SbatchError(f"trainer.output_dir ({log_dir.parent.parent}) holds a space, quote or %, which an #SBATCH --output "
                          "line cannot carry; choose a plain path")  # fmt: skip
    try:
        log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output's folder
    except OSError as exc:  # written elsewhere than the cluster: say what to do there
        print(f"warning: cannot create {log_dir} here ({exc.strerror}); create it on the cluster before "
              f"submitting: mkdir -p {_sh(str(log_dir))}", file=sys.stderr)  # fmt: skip
    cuda = cfg.cluster.device == "cuda"
    values = {
        "VERSION": __version__,
        "CONFIG": str(args.config),
        "COMMAND": _command_line(args),
        "SCRIPT": args.out or "SCRIPT",
        "NNODES": str(cfg.cluster.nnodes),
        "GPUS_PER_NODE": str(cfg.cluster.gpus_per_node) if cuda else "0 (CPU)",
        "WAIT_GPUS": str(cfg.cluster.gpus_per_node) if cuda else "0",
        "GPU_DIRECTIVE": f"#SBATCH --gpus-per-node={cfg.cluster.gpus_per_node}" if cuda
        else "# (cluster.device is cpu: no GPUs requested)",
        "JOB_NAME": args.job_name or f"megarl-{Path(args.config).stem}",
        "PARTITION": args.partition,
        "TIME": args.time,
        "ACCOUNT_DIRECTIVE": f"#SBATCH --account={args.account}" if args.account else "# (no --account: the default account)",
        "LOG_DIR": str(log_dir),
        "LOG_DIR_SH": _sh(str(log_dir)),
        "SAVE_GRACE_S": str(args.save_grace),
        "ENV_SETUP": _env_setup(args.container),
        "WORKDIR": _sh(str(workdir)),
        "RAY_PORT": str(args.ray_port),
        "JOIN_TIMEOUT_S": str(args.join_timeout),
        "CONTAINER_ARGS": _container_args(args, workdir, [log_dir.parents[1], *_read_folders(cfg, args, workdir)]),
        "RAY_NODE_SH": read_template(BOOTSTRAP).rstrip("\n"),
        "LAUNCH": launch_command(args.config, args.overrides, cfg),
        "RESUME_COMMAND": _resume_command(args.out, RESUME_ENV),
    }  # fmt: skip
    script = read_template(TEMPLATE)
    for key, value in values.items():
        script = script.replace(f"@@{key}@@", value)
    assert "@@" not in script.replace("@@@", ""), "an unfilled blank in launch/megarl.sbatch"
    return script


def check_options(args: argparse.Namespace) -> None:
    """One line per option that cannot work, naming the option, its value and the fix."""
    limit = time_limit_s(args.time)
    if limit is None:
        raise SbatchError(f"--time ({args.time!r}) is not a Slurm time limit; use MINUTES, HH:MM:SS or D-HH:MM:SS (minutes and "
                          "seconds below 60, hours after D- below 24), e.g. 2-00:00:00, or 0 / UNLIMITED for none")  # fmt: skip
    if not 0 < args.save_grace < min(limit, 65536):  # Slurm's --signal takes at most 65535 s
        bound = (f"--time ({args.time} = {limit} s); the run needs time to train after the grace is kept back"
                 if limit < 65536 else "65536 s, the most Slurm's --signal takes")  # fmt: skip
        raise SbatchError(f"--save-grace ({args.save_grace} s) must be positive and shorter than {bound}")
    if not 1024 <= args.ray_port <= 65535:
        raise SbatchError(f"--ray-port ({args.ray_port}) must be between 1024 and 65535")
    taken = next((what for what, ports in RAY_DEFAULT_PORTS.items() if args.ray_port in ports), None)
    if taken:
        raise SbatchError(f"--ray-port ({args.ray_port}) is a port Ray keeps for {taken} (8265, 10001-19999, 52365), so the "
                          f"Ray head could not start; choose another, e.g. {DEFAULTS['ray_port']}")  # fmt: skip
    if args.container_mounts and not args.container:
        raise SbatchError(f"--container-mounts ({args.container_mounts}) needs --container IMAGE")
    if args.join_timeout <= 0:
        raise SbatchError(f"--join-timeout ({args.join_timeout} s) must be positive")
    for name in ("partition", "account", "job_name"):
        value = getattr(args, name)
        if value is not None and not re.fullmatch(r"[\w.,+-]+", value):
            raise SbatchError(f"--{name.replace('_', '-')} ({value!r}) may hold letters, digits and . , + - _ only")


def time_limit_s(text: str) -> float | None:
    """Seconds in a Slurm --time value (math.inf for no limit), or None when it is not one."""
    if text.strip().lower() in _NO_LIMIT:
        return math.inf
    m = _TIME.match(text.strip())
    if not m:
        return None
    days, first, *rest = (int(g) if g else None for g in m.groups())
    assert first is not None  # its group is not optional
    fields = [first, *(x for x in rest if x is not None)]
    # Only the leading field may run over (90 minutes, 30 hours); 25:99 is a typo, not 26:39.
    if any(x > 59 for x in fields[1:]) or (days is not None and first > 23):
        return None
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = fields + [0] * (3 - len(fields))
        total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    elif len(fields) == 3:  # H:M:S
        total = fields[0] * 3600 + fields[1] * 60 + fields[2]
    else:
        total = fields[0] * 60 + (fields[1] if len(fields) == 2 else 0)  # M, M:S
    return total or math.inf


def read_template(name: str) -> str:
    path = LAUNCH_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: megarl sbatch reads its templates from the checkout's launch/ folder; "
                                "install megarl from a checkout (pip install -e .)")  # fmt: skip
    return path.read_text()


def write_script(path: Path, script: str, overwrite: bool) -> None:
    """Write ``script`` to ``path`` (executable); an existing file is replaced only with --overwrite."""
    from megarl.commands.outputs import check_new_file
    from megarl.kept_files import write_atomically

    check_new_file(path, overwrite, fix="choose another --out", in_existing_folder=True)
    write_atomically(path, script, mode=0o755)


def _read_folders(cfg, args: argparse.Namespace, workdir: Path) -> list[Path]:
    """The folders a run reads: the config's, the model's, the data's, a custom reward's."""
    files = [args.config, *(f.path for f in cfg.data.train_files), *cfg.data.val_files]
    files += [cfg.reward.custom.path] if cfg.reward.custom else []
    folders = [(workdir / f).resolve().parent for f in files]
    return folders + ([(workdir / cfg.model.path).resolve()] if cfg.model.path else [])


def _warn_missing_here(cfg, workdir: Path) -> None:
    """A warning, not a refusal, for the files the run reads that this machine does not have:
    the nodes may see paths (a cluster filesystem) that the machine writing the script does not."""
    named = [("model.path", cfg.model.path), *((f"data.train_files[{i}]", f.path) for i, f in enumerate(cfg.data.train_files)),
             *((f"data.val_files[{i}]", f) for i, f in enumerate(cfg.data.val_files)),
             ("reward.custom.path", cfg.reward.custom.path if cfg.reward.custom else None)]  # fmt: skip
    missing = [(key, str(value)) for key, value in named if value and not (workdir / value).exists()]
    if missing:
        relative = any(not Path(value).is_absolute() for _, value in missing)
        print(f"warning: not on this machine: {', '.join(f'{key} ({value})' for key, value in missing)}; the nodes must "
              f"see them there{f' (relative paths from {workdir})' if relative else ''}", file=sys.stderr)  # fmt: skip


def _command_line(args: argparse.Namespace) -> str:
    """The `megarl sbatch` command that writes this script again."""
    words = ["megarl", "sbatch", str(args.config), *args.overrides, "--partition", args.partition, "--time", args.time]
    for option in ("account", "container", "container_mounts", "job_name", "out"):
        if getattr(args, option):
            words += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    words += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k, v in DEFAULTS.items() if getattr(args, k) != v]
    return shlex.join(words)


def _resume_command(out: str | None, env: str) -> str:
    """The line that sets what megarl prints on a stop: `sbatch SCRIPT` (megarl's own resume command
    would name this job's Ray address, gone once the job ends). A script written to stdout learns
    its path from Slurm: `Command=` is the path given to sbatch, relative to the submit directory."""
    if out:
        return f"export {env}={_sh('sbatch ' + shlex.quote(str(Path(out).resolve())))}  # what megarl prints on a stop"
    return "\n".join([
        "# What megarl prints on a stop: this script (written to stdout), as it was submitted.",
        "SUBMITTED=$(scontrol show job \"$SLURM_JOB_ID\" 2>/dev/null | sed -n 's/^ *Command=//p')",
        '[[ $SUBMITTED == /* ]] || SUBMITTED=${SLURM_SUBMIT_DIR:-$PWD}/$SUBMITTED',
        'if [[ -f $SUBMITTED ]]; then',
        f'  {env}="sbatch $(printf %q "$(realpath "$SUBMITTED")")"',
        "else  # submitted on stdin: no file to name",
        f'  {env}="sbatch (this job\'s batch script again)"',
        "fi",
        f"export {env}",
    ])  # fmt: skip


def _env_setup(container: str | None) -> str:
    if container:
        return "# megarl, Ray and Python come from the container image (--container)."
    if sys.prefix != sys.base_prefix:  # written from a virtual environment: the nodes use the same one
        return f"source {_sh(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return "# megarl and Ray are on PATH (no virtual environment was active when this script was written)."


def _container_args(args: argparse.Namespace, workdir: Path, needed: list[Path]) -> str:
    """pyxis options: the image, one container name for the whole job, and mounts for the
    working directory and the folders the run reads or writes outside it, the job's Ray folder
    ($RAY_HOST_TMP), plus the user's own."""
    if not args.container:
        return ""
    paths = [workdir, *(p for p in needed if not p.is_relative_to(workdir))]
    mounts = [*dict.fromkeys(f"{p}:{p}" for p in paths), *([args.container_mounts] if args.container_mounts else [])]
    # Named: pyxis unpacks the image once per node and every later step of the job reuses that
    # filesystem (an unnamed container is unpacked again for each step: the Ray node, the wait, the driver).
    words = [f"--container-image={args.container}", f"--container-mounts={','.join(mounts)}", f"--container-workdir={workdir}"]
    quoted = ['"' + re.sub(r'(["$`\\])', r"\\\1", w) + '"' for w in words]  # double quotes: $RAY_HOST_TMP expands
    quoted[1] = quoted[1][:-1] + ',${RAY_HOST_TMP}:/tmp/ray"'
    return " ".join([quoted[0], f'"--container-name={CONTAINER_NAME}"', *quoted[1:]])


def _sh(text: str) -> str:
    return shlex.quote(text)
