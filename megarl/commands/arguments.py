"""Arguments several commands share."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser) -> None:
    """CONFIG and its KEY=VALUE overrides (plan, launch)."""
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.n=8 actor.optimizer.lr=2e-6")
