"""Arguments several commands share."""

from __future__ import annotations

import argparse
import os


def add_config_args(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """CONFIG and its KEY=VALUE overrides (plan, launch)."""
    p.add_argument("config", type=user_path, nargs="?" if optional else None, help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rollout.n=8 actor.optimizer.lr=2e-6 (every key: megarl config [SECTION])")


def user_path(text: str) -> str:
    """A path argument with ``~`` expanded: the shell leaves a quoted '~/x' as it is, and a literal
    ./~ folder made from it invites an `rm -rf ~`. Use as ``type=user_path``."""
    return os.path.expanduser(text)
