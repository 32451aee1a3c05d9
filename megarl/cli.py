"""The `megarl` command line: the user's manual is `megarl --help` and each subcommand's help.

Subcommand handlers import heavy libraries (torch, megatron, ray) lazily inside themselves,
so `megarl plan` stays fast.
"""

from __future__ import annotations

import argparse
import json
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
    _add_plan(sub)
    from megarl.data.commands import register as register_data

    register_data(sub)
    return parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.n=8 actor.optimizer.lr=2e-6")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="check a config and print the placement and memory plan (no GPU, no weights needed)",
        description="Validate a config without starting anything: layout (TP x PP x DP per role), batch arithmetic, "
        "algorithm needs, sequence lengths and the memory per GPU. Prints one row per GPU; exits 1 with every "
        "problem (field, values, fix) when the run cannot work.",
    )
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--check-files", action="store_true", help="also check that data, model and reward files exist (as launch does)")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from megarl.config.loading import load_config
    from megarl.config.plan_report import print_plan
    from megarl.config.planner import make_plan

    cfg = load_config(args.config, args.overrides)
    plan = make_plan(cfg, check_files=args.check_files)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print_plan(cfg, plan)
    return 0


def main(argv: list[str] | None = None) -> int:
    from megarl.config.architectures import ArchError
    from megarl.config.loading import ConfigError
    from megarl.config.planner import PlanError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, PlanError, ArchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
