"""What every scorer of a step's samples (the reward workers, the reward model's role, the LLM
judge) does with the samples it failed on: stop the run in one line when they reach
reward.max_failed_fraction of the call, else log the first few and let them score 0.

An outcome is ``(kind, value_or_message, ...)`` with kind "ok", "error" or "timeout".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)
LOGGED_ERRORS_PER_CALL = 3  # failures logged with their sample per call (each is counted in the metrics)


class RewardError(RuntimeError):
    """Reward functions failed on too many of a step's samples (reward.max_failed_fraction), or
    the reward workers stopped taking samples (one died or hung while loading)."""


def check_failed_fraction(what: str, outcomes: Sequence[tuple], data_sources: Sequence[str], *, limit: float,
                          stops: str, fix: Callable[[str], str], trace: str = "") -> None:  # fmt: skip
    """RewardError when the failed outcomes reach ``limit`` of the call's: ``what`` failed on how
    many (errors, timeouts), ``stops`` (what the stop means for the caller), the first failure with
    ``fix(its kind)``, and ``trace`` (the first error's traceback) on the lines below."""
    failed = [i for i, o in enumerate(outcomes) if o[0] != "ok"]
    n = len(outcomes)
    if not n or not failed or len(failed) < limit * n:
        return
    errors = sum(outcomes[i][0] == "error" for i in failed)
    first = failed[0]
    kind, message = outcomes[first][0], outcomes[first][1]
    raise RewardError(
        f"{what} failed on {len(failed)} of {n} samples ({errors} errors, {len(failed) - errors} timeouts), at least "
        f"reward.max_failed_fraction ({limit:g}) of them; {stops}. First failure (data_source={data_sources[first]!r}): "
        f"{message}; {fix(kind)}" + (f"\n{trace.rstrip()}" if trace else "")
    )


def log_failures(what: str, outcomes: Sequence[tuple], data_sources: Sequence[str], responses: Sequence[object],
                 ground_truths: Sequence[object] | None = None) -> None:  # fmt: skip
    """The call's first LOGGED_ERRORS_PER_CALL failures, each with its sample, as warnings."""
    failed = [i for i, o in enumerate(outcomes) if o[0] != "ok"]
    for i in failed[:LOGGED_ERRORS_PER_CALL]:
        truth = "" if ground_truths is None else f" ground_truth={str(ground_truths[i])[:200]!r}"
        log.warning("%s %s (scored 0): %s | data_source=%r%s response=%r", what, outcomes[i][0], outcomes[i][1],
                    data_sources[i], truth, str(responses[i])[:300])  # fmt: skip
