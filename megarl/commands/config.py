"""`megarl config [SECTION | KEY]`: the configuration reference, read from the typed config models."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print every config key with its default and meaning",
                       description="The configuration reference, read from megarl's typed config models.")
    p.add_argument("section", nargs="?", default=None, metavar="SECTION | KEY",
                   help="a section such as rollout or actor.optimizer, or one key such as actor.optimizer.lr (default: all)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megarl.config.documentation import describe

    print(describe(args.section))
    return 0
