"""The CPU demo's task: reverse three digits, with dense partial credit.

``ground_truth`` is the expected answer (the prompt's 3 digits already reversed, e.g. "321"
for the prompt "123"); ``solution_str`` is the decoded response without special tokens, so a
response that stopped with EOS right after its answer is exactly 3 characters long.

Score = 0.25 per position i in 0..2 where response[i] == ground_truth[i], plus 0.25 when the
response is exactly 3 characters (the model ended right after the digits). A perfect answer
scores 1.0; a constant output (e.g. always "000") averages 0.25 * 3 / 10 + 0.25 = 0.325 over
uniform targets, well below what learning the reversal earns.
"""

from __future__ import annotations

DIGITS = 3
CREDIT = 0.25


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Partial credit in [0, 1]: 0.25 per correct position plus 0.25 for stopping after 3 characters."""
    truth = str(ground_truth)
    if len(truth) != DIGITS or not truth.isdigit():
        raise ValueError(f"reverse_digits ground_truth must be {DIGITS} digits, got {truth!r}")
    correct = sum(1 for i in range(min(DIGITS, len(solution_str))) if solution_str[i] == truth[i])
    stopped = len(solution_str) == DIGITS
    return CREDIT * correct + (CREDIT if stopped else 0.0)
