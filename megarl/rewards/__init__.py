"""Rewards: rule scorers (gsm8k, math, code sandbox, reverse_digits), user functions, reward
models, and the parallel scorer with per-sample timeouts that the trainer calls.

- ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``: verl's
  signature, dispatching on ``data_source`` to a built-in scorer (``SCORERS``).
- ``RewardScorer(cfg: RewardConfig)``: ``.score(...) -> ScoreResult`` in warm worker processes.
"""

from megarl.rewards.registry import DATA_SOURCES, SCORERS, compute_score, resolve
from megarl.rewards.scorer import RewardScorer, ScoreResult

__all__ = ["DATA_SOURCES", "SCORERS", "RewardScorer", "ScoreResult", "compute_score", "resolve"]
