"""The CPU demo's task: reverse a string of digits, with dense partial credit.

``ground_truth`` is the expected answer (the prompt's digits already reversed, e.g. "321" for
the prompt "123"; megarl/data/tasks.py writes it); ``solution_str`` is the decoded response with
a final EOS dropped and other special tokens kept (megarl/rollout/batching.py response_texts), so
a response that stopped with EOS right after its answer has exactly ``len(ground_truth)``
characters, and one that went on with another special token has more.

With n = len(ground_truth) digits (3 in the demo), each of n + 1 checks earns 1 / (n + 1)
(0.25 for 3 digits): one per position i where response[i] == ground_truth[i], and one when
the response is exactly n characters long (the model ended right after the digits). A perfect
answer scores 1.0; a constant output (e.g. always "000") averages 0.25 * 3 / 10 + 0.25 = 0.325
over uniform 3-digit targets, well below what learning the reversal earns.
"""

from __future__ import annotations


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Partial credit in [0, 1]: 1/(n+1) per correct position plus 1/(n+1) for stopping after n characters."""
    truth = str(ground_truth)
    if not truth.isdigit():
        raise ValueError(f"reverse_digits ground_truth must be a string of digits, got {truth!r}")
    return position_credit(solution_str, truth)


def position_credit(text: str, truth: str) -> float:
    """1/(n+1) per position where ``text`` matches ``truth``, plus 1/(n+1) for the same length
    (n = len(truth)); the tool-use demo's scorer grades its call and answer with it too."""
    n = len(truth)
    correct = sum(1 for i in range(min(n, len(text))) if text[i] == truth[i])
    return (correct + (len(text) == n)) / (n + 1)
