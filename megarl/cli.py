"""The `megarl` command line: the user's manual is `megarl --help` and each subcommand's help.

Each subcommand lives in megarl/commands/ (``register`` adds it to the parser); handlers import
heavy libraries (torch, megatron, ray) lazily inside themselves, so `megarl plan` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from megarl import __version__

EPILOG = """examples:
  megarl plan configs/qwen72b_grpo.yaml                 check a config, print the GPU placement
  megarl plan configs/tiny_grpo.yaml rollout.n=4 --json overrides are key.path=value (YAML values)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="RL post-training of LLMs: Megatron-core trains, SGLang generates, Ray drives. "
        "Every config is checked (topology, batches, memory) before anything starts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from megarl.commands import config, convert, data, demo, launch, plan, plot

    for command in (plan, launch, config, convert, demo, plot, data):
        command.register(sub)
    return parser


def setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    from megarl.config.architectures import ArchError
    from megarl.config.loading import ConfigError
    from megarl.config.planner import PlanError

    parser = build_parser()
    # KEY=VALUE overrides may also come after options (`launch cfg.yaml --address auto rollout.n=4`).
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging()
    try:
        return args.handler(args)
    except (ConfigError, PlanError, ArchError, FileNotFoundError, FileExistsError) as exc:  # user mistakes: one clear message, exit 1
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
