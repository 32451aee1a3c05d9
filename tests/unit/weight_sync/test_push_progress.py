"""The deadline report of a weight push: who the push waits for, from the ranks' progress files."""

import time

from megarl.weight_sync.progress import (
    PushProgress,
    RankPlace,
    push_group,
    push_report,
    read_place,
)


def test_progress_is_written_beside_the_rank_log_and_read_back(tmp_path):
    log = tmp_path / "policy_rank3.log"
    progress = PushProgress(str(log), group="1")
    progress.start(7)
    progress.mark(7, "exporting bucket 2")
    place = read_place(log)
    assert (place.version, place.group, place.order, place.phase) == (7, "1", 2, "exporting bucket 2")
    assert abs(place.since - time.time()) < 5
    assert not (tmp_path / "policy_rank3.log.push.tmp").exists()
    assert read_place(tmp_path / "policy_rank9.log") is None  # never written: no place


def test_without_a_rank_log_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGARL_RANK_LOG", raising=False)
    monkeypatch.chdir(tmp_path)
    PushProgress().mark(1, "exporting bucket 1")
    assert list(tmp_path.iterdir()) == []


def test_a_rank_behind_the_others_of_its_stage_is_named():
    now = time.time()
    places = {0: RankPlace(4, "0", 9, now - 6, "checking the export"), 1: RankPlace(4, "0", 3, now - 7, "exporting bucket 2"),
              2: RankPlace(4, "0", 9, now - 6, "checking the export")}  # fmt: skip
    report = push_report(4, places, {0: True, 1: True, 2: True}, waiting=[0, 1, 2])
    assert report.startswith("policy rank(s) [1] are behind the others of their pipeline stage")
    assert "policy rank 1 (stage 0): exporting bucket 2 (for 7 s)" in report


def test_stages_compare_only_within_themselves_and_returned_ranks_are_not_behind():
    # Distributed transport at PP=2: stage 1 waits at its first barrier while stage 0 sends; rank
    # 0 of stage 0 is stuck sending bucket 3, rank 1 of stage 0 already wrote more marks.
    now = time.time()
    places = {0: RankPlace(4, "0", 5, now, "sending bucket 3"), 1: RankPlace(4, "0", 8, now, "waiting for pipeline stage 0's broadcast to end"),
              2: RankPlace(4, "1", 2, now, "waiting for pipeline stage 0's broadcast to end"),
              3: RankPlace(4, "1", 2, now, "waiting for pipeline stage 0's broadcast to end")}  # fmt: skip
    report = push_report(4, places, dict.fromkeys(range(4), True), waiting=[0, 1, 2, 3])
    assert report.startswith("policy rank(s) [0] are behind the others of their pipeline stage"), report
    # A rank that returned is never the one waited for.
    report = push_report(4, places, dict.fromkeys(range(4), True), waiting=[1, 2, 3])
    assert not report.startswith("policy rank(s) [0]") and "policy rank 0 (stage 0): sending bucket 3 (for 0 s, returned)" in report


def test_silent_ranks_come_first_and_ranks_still_on_an_old_push_are_named():
    now = time.time()
    places = {0: RankPlace(4, "0", 5, now, "sending bucket 3"), 1: RankPlace(3, "0", 40, now - 100, "done"), 2: None}
    report = push_report(4, places, {0: True, 1: True, 2: False}, waiting=[0, 1, 2])
    assert report.startswith("policy rank(s) [2] did not write their stacks: stopped or dead")
    assert "policy rank(s) [1, 2] never started push 4" in report
    assert "behind" not in report  # one rank on the push: nobody to be behind


def test_ranks_at_the_same_place_are_not_called_behind():
    now = time.time()
    places = {r: RankPlace(2, "0", 4, now, "sending bucket 1") for r in range(2)}
    assert push_report(2, places, {0: True, 1: True}, waiting=[0, 1]) == (
        "policy rank 0 (stage 0): sending bucket 1 (for 0 s); policy rank 1 (stage 0): sending bucket 1 (for 0 s)")


def test_ranks_that_all_finished_are_not_blamed():
    now = time.time()
    places = {r: RankPlace(2, "0", 6, now, "done") for r in range(2)}
    report = push_report(2, places, {0: True, 1: True}, waiting=[0, 1])
    assert report.startswith("every policy rank had finished its part: the results did not reach the driver")


def test_a_rank_whose_push_raised_is_named_before_ranks_merely_behind():
    now = time.time()
    places = {0: RankPlace(3, "0", 8, now, "failed (RuntimeError: engine gone), meeting the others in the export check"),
              1: RankPlace(3, "0", 90, now, "waiting for pipeline stage 0's broadcast to end")}  # fmt: skip
    report = push_report(3, places, {0: True, 1: True}, waiting=[0, 1])
    assert report.startswith("policy rank(s) [0] failed their push"), report
    assert "policy rank 0 (stage 0): failed (RuntimeError: engine gone)" in report


def test_the_leader_collecting_every_stage_is_not_compared_with_its_stage_peers():
    # in_process at TP=2 x PP=2: the leader's stream carries both stages' buckets, its TP peer's
    # only stage 0's, so the peer writes fewer places for the same progress. The leader waits for
    # stage 1 (stuck sending): its stage peer must not be named behind it.
    now = time.time()
    places = {0: RankPlace(5, push_group(0, True), 30, now, "exporting bucket 9"),
              1: RankPlace(5, push_group(0, False), 12, now, "checking the export"),
              2: RankPlace(5, push_group(1, False), 14, now, "sending bucket 4"),
              3: RankPlace(5, push_group(1, False), 18, now, "checking the export")}  # fmt: skip
    report = push_report(5, places, dict.fromkeys(range(4), True), waiting=[0, 1, 2, 3])
    assert report.startswith("policy rank(s) [2] are behind the others of their pipeline stage"), report
    assert "policy rank 0 (stage 0, receiving every stage): exporting bucket 9" in report
    assert push_group(0, False) == "0" and push_group(1, False) == "1"
