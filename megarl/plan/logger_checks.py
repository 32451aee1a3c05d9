"""Pre-launch checks of the metric loggers that only fail once a run has started (the sinks
themselves: megarl/trainer/metric_sinks.py)."""

from __future__ import annotations

import netrc
import os
import sys
from urllib.parse import urlparse

WANDB_LOGIN_FIX = "run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` later)"


def wandb_login_problem() -> str | None:
    """Why W&B would not start a run here for want of an API key, or None: checked before
    launch, since the run only meets it after the cluster started and the checkpoint loaded.
    Only where W&B cannot ask for a key (no terminal: a Slurm job, nohup) and would go online.
    The environment and netrc are read here; any other source W&B has (its settings files) is
    W&B's own lookup, which starts nothing when no key is found (wandb.login, verify=False)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or _has_terminal():
        return None
    if os.environ.get("WANDB_API_KEY") or _netrc_has(urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname):
        return None
    import wandb

    try:
        wandb.login(verify=False)
    except wandb.errors.Error as exc:
        return f"W&B has no API key here and no terminal to ask for one ({' '.join(str(exc).split())}); {WANDB_LOGIN_FIX}"
    return None


def _has_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # a closed stdin
        return False


def _netrc_has(host: str | None) -> bool:
    try:
        return bool(host and netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None)
    except (OSError, netrc.NetrcParseError):  # no file, or one W&B would not read either
        return False
