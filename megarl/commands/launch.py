"""`megarl launch`: check everything, then start Ray (embedded or a cluster) and train.

Every check the planner can make, and every check of the files and directories the run needs
(megarl/plan/preflight.py), runs before Ray starts: a bad config costs seconds, not a cluster
allocation. A run whose output_dir already holds its last step says so and starts nothing.

While it runs, the driver logs to <output_dir>/logs/driver.log as well (with the traceback of
whatever ended the run), Ctrl-C and SIGTERM stop it cleanly (megarl/trainer/watchdog.py), and
the exact command that resumes it is printed when it stops. The run itself: megarl/trainer/launch.py.
"""

from __future__ import annotations

import argparse
from functools import partial

from megarl.commands.arguments import add_config_args
from megarl.commands.supervision import (
    Supervision,
    driver_user_code,
    starts_ray,
    supervised_command,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="train: check the config, start Ray (embedded or a cluster), run the RL loop",
        description="Run a config end to end. Every planner check, and every check of the data, model, reward "
        "and output files (readable, the right columns, writable, ...), runs before Ray starts. Without --address "
        "(or cluster.ray_address) an embedded local Ray is started; 'auto' or host:port attaches to a running "
        "cluster. Metrics go to the console, <output_dir>/metrics.jsonl and TensorBoard; checkpoints to "
        "<output_dir>/checkpoints (resume=auto picks up the latest valid one). Ctrl-C or SIGTERM stops after the "
        "current step, saves a checkpoint (trainer.checkpoint_on_signal) and prints the command that resumes.",
    )
    add_config_args(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="Ray cluster to attach to: auto or host:port (default: embedded local Ray)")
    where.add_argument("--in-process", action="store_true",
                       help="no Ray: every role in this process (a world of one, e.g. one GPU under torchrun; needs "
                       "cluster.nnodes=1 cluster.gpus_per_node=1 and rollout.engine=torch)")  # fmt: skip
    p.set_defaults(handler=supervised_command(_run, _prepare))


def _prepare(args: argparse.Namespace) -> Supervision:
    """A config mistake, or an output folder another run holds: its line from the command's
    process, no driver started. The driver reports the command that resumes it
    (megarl/trainer/launch.py)."""
    from megarl.config.loading import load_config
    from megarl.trainer.run_lock import output_dir_lock

    cfg = load_config(args.config, args.overrides)
    return Supervision(ray=starts_ray(args), user_code=driver_user_code(cfg),
                       holds=partial(output_dir_lock, cfg.trainer.output_dir))  # a run there: refused before the driver's imports


def _run(args: argparse.Namespace) -> int:
    from megarl.trainer.launch import launch

    launch(args.config, args.overrides, args.address, in_process=args.in_process)
    return 0
