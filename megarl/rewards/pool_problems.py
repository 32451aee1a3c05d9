"""What the reward workers' pool's hangs and deaths mean, for the scorer (megarl/rewards/scorer.py):
per function, the timeouts and deaths of one scoring call (:class:`HangWatch`), and what a worker
that hung or died in its initializer, or a pool that broke with no task in sight, says as one line."""

from __future__ import annotations

import logging
import os

from megarl.config.sections import RewardConfig
from megarl.rewards.registry import user_function

log = logging.getLogger("megarl.rewards.scorer")


class HangWatch:
    """Per function, in one scoring call: timeouts so far and whether it ever returned."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self.timeouts: dict[str, int] = {}
        self.answered: set[str] = set()
        self.deaths: dict[str, int] = {}  # tasks that killed their worker since the function last returned

    def timed_out(self, function: str, sample: tuple) -> None:
        self.timeouts[function] = self.timeouts.get(function, 0) + 1
        if sum(self.timeouts.values()) == 1:  # at once, not when the batch ends
            log.warning("reward: %s timed out after %g s (reward.timeout_s) | data_source=%r response=%r",
                        function, self.timeout_s, sample[0], str(sample[1])[:200])

    def returned(self, function: str) -> None:
        self.answered.add(function)
        self.deaths[function] = 0

    def died(self, function: str) -> int:
        """A task of ``function`` killed its worker: it ended, it did not hang; the deaths in a row."""
        self.answered.add(function)
        self.deaths[function] = self.deaths.get(function, 0) + 1
        return self.deaths[function]

    def hopeless(self, function: str) -> bool:
        """One round of the pool timed out on this function, and it never returned a score."""
        return function not in self.answered and self.timeouts.get(function, 0) >= self.workers


def start_problem(cfg: RewardConfig, hung: bool, limit_s: float) -> str:
    """A worker hung or died in its initializer (no task runs there, so pebble says nothing useful):
    what it was loading and the fix, as one line."""
    files = [cfg.custom.path] if cfg.custom is not None else _user_files(cfg) if cfg.model is None else []
    if files:
        what = "reward.custom" if cfg.custom is not None else "reward.functions"
        doing = "importing " + " and ".join(repr(os.path.basename(f)) for f in files)
        fix = ("check it for work done at import (network, locks, long loops)" if hung
               else "import it on its own to see why: " + ", ".join(_import_command(os.path.abspath(f)) for f in files))
    elif cfg.model is not None:
        what, doing = "reward.model", f"loading {cfg.model.path}"
        fix = ("check that it loads in a plain Python process" if hung
               else "check the memory that reward.workers copies of it need (a worker killed for memory dies so)")
    else:
        what, doing, fix = "reward scorers", "importing math_verify", "check the Python environment (megarl doctor)"
    if hung:  # (not the samples': reward.timeout_s starts when a loaded worker takes one)
        return f"{what}: {doing} took more than {limit_s:g} s in a reward worker; {fix}"
    # a crash in C, os._exit or the OOM killer: no traceback to pass on
    return f"{what}: a reward worker died while {doing} before it took a sample; {fix}"


def break_problem(cfg: RewardConfig, loaded: int, unscored: list[tuple], limit_s: float) -> str:
    """The pool broke (a worker died with no task pebble saw start) at the start check, or again in
    a call's new pool: what is known, as one line. No worker of the pool finished loading: one died
    loading. Otherwise a loaded worker died between samples: killed from outside, or by a sample that
    ends its process before pebble read the worker's acknowledgement of it (which one is unknown)."""
    if not loaded:
        return start_problem(cfg, False, limit_s)
    what = "reward.custom" if cfg.custom else "reward.model" if cfg.model else "reward.functions" if _user_files(cfg) else "reward scorers"
    cause, fix = "killed from outside (the OOM killer; see dmesg)", "check dmesg"
    if unscored:
        cause += (f" or by a sample that ends its process at once (os._exit, a crash in C), maybe one of the call's "
                  f"{len(unscored)} unscored samples (the first: data_source={unscored[0][0]!r} "
                  f"response={str(unscored[0][1])[:80]!r})")
        fix += ", then score those samples in a plain Python process"
    return f"{what}: a reward worker died after it loaded, before pebble saw it take a sample: {cause}; {fix}"


def _user_files(cfg: RewardConfig) -> list[str]:
    """The files of reward.functions' user functions (``file.py:function``), each once."""
    found = [user_function(name) for name in cfg.functions.values()]
    return sorted({f[0] for f in found if f is not None})


def _import_command(path: str) -> str:
    return f'python -c "import runpy; runpy.run_path({path!r})"'
