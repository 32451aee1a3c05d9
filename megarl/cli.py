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
    _add_launch(sub)
    _add_config(sub)
    _add_convert(sub)
    _add_demo(sub)
    _add_plot(sub)
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


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="train: check the config, start Ray (embedded or a cluster), run the RL loop",
        description="Run a config end to end. Every planner check (and that data, model and reward files exist) "
        "runs before Ray starts. Without --address (or cluster.ray_address) an embedded local Ray is started; "
        "'auto' or host:port attaches to a running cluster. Metrics go to the console, "
        "<output_dir>/metrics.jsonl and TensorBoard; checkpoints to <output_dir>/checkpoints (resume=auto picks up "
        "the latest valid one).",
    )
    _add_config_args(p)
    p.add_argument("--address", default=None, help="Ray cluster to attach to: auto or host:port (default: embedded local Ray)")
    p.set_defaults(handler=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from megarl.trainer.launch import launch

    _setup_logging()
    launch(args.config, args.overrides, args.address)
    return 0


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print every config key with its default and meaning",
                       description="The configuration reference, read from megarl's typed config models.")
    p.add_argument("section", nargs="?", default=None, help="a section such as rollout or actor.optimizer (default: all)")
    p.set_defaults(handler=lambda args: print(_describe(args.section)) or 0)


def _describe(section: str | None) -> str:
    from megarl.config.reference import describe

    return describe(section)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="export a training checkpoint's policy as a Hugging Face model directory (verified)",
        description="Rebuilds the policy with the run's layout, loads CHECKPOINT (a <output_dir>/checkpoints/step_NNNNNN "
        "directory), writes HF safetensors + index with the config and tokenizer of model.path, then imports the "
        "written files back and checks every parameter equals the trained one bit for bit.",
    )
    p.add_argument("checkpoint", help="a step_NNNNNN checkpoint directory (a torn one is refused)")
    p.add_argument("out", help="the HF model directory to write")
    p.add_argument("--config", default=None, help="the run's config (default: the config.yaml saved in the checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(handler=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from megarl.checkpoint.hf_export import convert_checkpoint

    _setup_logging()
    print(convert_checkpoint(args.checkpoint, args.out, args.config, args.overwrite))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the CPU demo: GRPO teaches a tiny model to reverse three digits (what `make demo` runs)",
        description="Builds a tiny random-init model and the task data under --root (once), trains it with "
        "configs/tiny_grpo.yaml on this machine (embedded Ray, 2 Megatron processes, torch engine) and writes "
        "<root>/run/curves.png.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.total_steps=50")
    p.add_argument("--config", default="configs/tiny_grpo.yaml", help="the demo config (default: %(default)s)")
    p.add_argument("--root", default="outputs/demo", help="where the model, data and run go (default: %(default)s)")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from megarl.trainer.demo import run_demo

    _setup_logging()
    png = run_demo(args.config, args.overrides, args.root)
    print(f"curves: {png}")
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw reward and KL curves of a run to a PNG",
                       description="Reads RUN_DIR/metrics.jsonl and writes the reward, KL and entropy curves.")
    p.add_argument("run_dir", help="a run's trainer.output_dir")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    p.set_defaults(handler=_run_plot)


def _run_plot(args: argparse.Namespace) -> int:
    from megarl.trainer.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


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

    parser = build_parser()
    # KEY=VALUE overrides may also come after options (`launch cfg.yaml --address auto rollout.n=4`).
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.handler(args)
    except (ConfigError, PlanError, ArchError, FileNotFoundError, FileExistsError) as exc:  # user mistakes: one clear message, exit 1
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
