"""`megarl plan CONFIG [k=v ...]`: check a config and print the placement and memory plan."""

from __future__ import annotations

import argparse
import json

from megarl.commands.arguments import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="check a config and print the placement and memory plan (no GPU, no weights needed)",
        description="Validate a config without starting anything: layout (TP x PP x DP per role), batch arithmetic, "
        "algorithm needs, sequence lengths, the memory per GPU, and what one weight push moves per GPU on each link "
        "(with a lower-bound time at the cluster's bandwidths). Prints one row per GPU; exits 2 with every problem "
        "(field, values, fix) when the run cannot work.",
    )
    add_config_args(p, optional=True)  # not with --list-archs
    p.add_argument("--list-archs", action="store_true", help="list the built-in architectures (model.arch) and exit")
    p.add_argument("--json", action="store_true", help='print one JSON object: the plan with "ok": true (and "step": the step\'s phases in order with their workers), or '
                   '{"ok": false, "issues": [{field, message, level}], "warnings": [...]} (a config that cannot be read: "error") with exit code 2')
    p.add_argument("--check-files", action="store_true", help="also run the checks launch makes before Ray starts: the data, model, reward, tool and "
                   "output files, the checkpoints to resume, your own functions named by import path, and the SGLang servers' Python "
                   "(sglang, and its NCCL version against the trainer's)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megarl.config.architectures import describe_archs
    from megarl.config.loading import ConfigError, load_config
    from megarl.plan.planner import PlanError, make_plan
    from megarl.plan.report import print_plan
    from megarl.progress import still_waiting
    from megarl.trainer.watchdog import run_stoppable

    if args.list_archs:
        print(describe_archs())
        return 0
    try:
        if args.config is None:
            raise ConfigError("megarl plan needs a CONFIG file (or --list-archs)")
        cfg = load_config(args.config, args.overrides)
        # a Ctrl-C, SIGTERM or SIGHUP while --check-files imports user code: one line, the check's child killed
        with still_waiting("checking the config and its files"):
            plan = run_stoppable(lambda: make_plan(cfg, check_files=args.check_files),
                                 "while checking the config and its files; nothing was started")
    except (ConfigError, PlanError) as exc:
        if not args.json:
            raise
        return _print_refusal(exc)
    if args.json:
        from megarl.plan.step_timeline import timeline_dict

        print(json.dumps({"ok": True, **plan.to_dict(), "step": timeline_dict(cfg)}, indent=2, default=str))
    else:
        print_plan(cfg, plan)
    return 0


def _print_refusal(exc: Exception) -> int:
    """--json's answer to a refused config: a script reads stdout as JSON whether or not the plan
    passed; the exit code stays the CLI's user error."""
    from dataclasses import asdict

    from megarl.plan.planner import PlanError
    from megarl.terminal import EXIT_USER

    if isinstance(exc, PlanError):
        out: dict = {"ok": False, "issues": [asdict(i) for i in exc.issues], "warnings": [asdict(w) for w in exc.warnings]}
    else:  # the config could not be read or validated: no planner issues, the loader's message
        out = {"ok": False, "error": str(exc), "issues": []}
    print(json.dumps(out, indent=2))
    return EXIT_USER
