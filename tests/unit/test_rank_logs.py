"""What an error quotes of a rank's log (megarl/rank_logs.py ``without_warnings``, used by the
worker group's ``log_tail``): torch's and Python's warnings, each with its source line, are left
out; the rank's own lines and a traceback's indented lines stay; the log file keeps them all."""

from __future__ import annotations

from pathlib import Path

from megarl.rank_logs import without_warnings
from megarl.ray_cluster.worker_group import WorkerGroup

# As a rank killed in SFTRank.save_model leaves its log: the warnings between its own lines.
LOG = """\
[megarl] rank 0 pid 4242: building SFTRank
/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict_saver.py:182: FutureWarning: `save_state_dict` is deprecated and will be removed in future versions.Please use `save` instead.
  warnings.warn(
/venv/lib/python3.11/site-packages/megatron/core/dist_checkpointing/strategies/torch.py:755: UserWarning: TypedStorage is deprecated.
  storage = tensor.untyped_storage()
[W1012 10:00:00.123456 ProcessGroupGloo.cpp:727] Warning: Unable to resolve hostname to a (local) address. (function operator())
saving model step 3
Traceback (most recent call last):
  File "/work/megarl/actors/sft_rank.py", line 88, in save_model
    self._save(path)
OSError: [Errno 28] No space left on device
/venv/lib/python3.11/site-packages/torch/utils/_pytree.py:185: DeprecationWarning: register_pytree_node is deprecated
"""


def test_warnings_and_their_source_lines_are_left_out_and_the_rest_stays():
    assert without_warnings(LOG.splitlines()) == [
        "[megarl] rank 0 pid 4242: building SFTRank",
        "saving model step 3",
        "Traceback (most recent call last):",
        '  File "/work/megarl/actors/sft_rank.py", line 88, in save_model',
        "    self._save(path)",
        "OSError: [Errno 28] No space left on device",
    ]


def test_a_line_that_only_mentions_a_warning_stays():
    lines = ["step 3: reward 0.5 (UserWarning: none)", "loaded 12 tensors", "  an indented line of the rank's own"]
    assert without_warnings(lines) == lines


def test_the_quoted_tail_counts_its_lines_after_the_warnings_are_left_out(tmp_path: Path):
    """A group's ``log_tail`` (what a rank's error quotes): the last N lines of the rank's own,
    however many warnings came between them; the file on disk is unchanged."""
    log = tmp_path / "policy_rank0.log"
    log.write_text(LOG + "".join(f"/x.py:{n}: UserWarning: again\n  warnings.warn(\n" for n in range(30)))
    group = WorkerGroup.__new__(WorkerGroup)  # a group's log fields only: no Ray, no ranks
    group.log_paths, group._log_starts, group.node_infos = [log], [0], []
    tail = group.log_tail(0, lines=3).splitlines()
    assert tail == ["  File \"/work/megarl/actors/sft_rank.py\", line 88, in save_model", "    self._save(path)",
                    "OSError: [Errno 28] No space left on device"]  # fmt: skip
    assert log.read_text().count("Warning: ") == 34
