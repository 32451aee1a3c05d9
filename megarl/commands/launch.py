"""`megarl launch`: check everything, then start Ray (embedded or a cluster) and train.

Every check the planner can make runs before Ray starts: a bad config costs seconds, not a
cluster allocation.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from megarl.commands.arguments import add_config_args
from megarl.config.loading import load_config
from megarl.config.planner import make_plan
from megarl.config.sections import MegaRLConfig

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="train: check the config, start Ray (embedded or a cluster), run the RL loop",
        description="Run a config end to end. Every planner check (and that data, model and reward files exist) "
        "runs before Ray starts. Without --address (or cluster.ray_address) an embedded local Ray is started; "
        "'auto' or host:port attaches to a running cluster. Metrics go to the console, "
        "<output_dir>/metrics.jsonl and TensorBoard; checkpoints to <output_dir>/checkpoints (resume=auto picks up "
        "the latest valid one).",
    )
    add_config_args(p)
    p.add_argument("--address", default=None, help="Ray cluster to attach to: auto or host:port (default: embedded local Ray)")
    p.set_defaults(handler=lambda args: launch(args.config, args.overrides, args.address) and 0)


def launch(config: str | Path, overrides: list[str], address: str | None = None) -> dict[str, float]:
    """Run the config to the end; returns the last step's metrics."""
    cfg = load_config(config, overrides)
    plan = make_plan(cfg, check_files=True)
    for warning in plan.warnings:
        log.warning("%s", warning)
    return run(cfg, plan, address)


def run(cfg: MegaRLConfig, plan, address: str | None = None) -> dict[str, float]:
    from megarl.actors.ray_groups.session import ray_session
    from megarl.trainer.build import build_trainer, shutdown

    address = address or cfg.cluster.ray_address
    local_cpus = None if address else max(os.cpu_count() or 1, _cpus_needed(plan))
    trainer = None
    with ray_session(address, num_cpus=local_cpus, num_gpus=None if address else _local_gpus(cfg)):
        try:
            trainer = build_trainer(cfg, plan)
            return trainer.fit()
        finally:
            shutdown(trainer)
            if cfg.trainer.profile_steps:
                from megarl.actors.ray_groups.session import save_timeline

                save_timeline(Path(cfg.trainer.output_dir) / "profile" / "ray_timeline.json")


def _cpus_needed(plan) -> int:
    """One logical CPU per process of each role (colocated roles share bundles but add CPUs)."""
    return sum(len(r.gpus) for name, r in plan.roles.items() if name != "rollout") + 1


def _local_gpus(cfg: MegaRLConfig) -> int | None:
    return cfg.cluster.gpus_per_node if cfg.cluster.device == "cuda" else None
