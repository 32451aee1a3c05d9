"""The deadline report of a weight push: who the push waits for, from the ranks' progress files."""

import time

from megarl.rollout.push_progress import PushProgress, RankPlace, push_report, read_place


def test_progress_is_written_beside_the_rank_log_and_read_back(tmp_path):
    log = tmp_path / "policy_rank3.log"
    progress = PushProgress(str(log))
    progress.start(7)
    progress.mark(7, "exporting bucket 2")
    place = read_place(log)
    assert (place.version, place.order, place.phase) == (7, 2, "exporting bucket 2")
    assert abs(place.since - time.time()) < 5
    assert not (tmp_path / "policy_rank3.log.push.tmp").exists()
    assert read_place(tmp_path / "policy_rank9.log") is None  # never written: no place


def test_without_a_rank_log_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGARL_RANK_LOG", raising=False)
    monkeypatch.chdir(tmp_path)
    PushProgress().mark(1, "exporting bucket 1")
    assert list(tmp_path.iterdir()) == []


def test_a_rank_behind_the_others_is_named():
    now = time.time()
    places = {0: RankPlace(4, 9, now - 6, "checking the export"), 1: RankPlace(4, 3, now - 7, "exporting bucket 2"),
              2: RankPlace(4, 9, now - 6, "checking the export")}  # fmt: skip
    report = push_report(4, places, {0: True, 1: True, 2: True})
    assert report.startswith("policy rank(s) [1] are behind the others (the rest wait for them in a collective)")
    assert "policy rank 1: exporting bucket 2 (for 7 s)" in report


def test_silent_ranks_come_first_and_ranks_still_on_an_old_push_are_named():
    now = time.time()
    places = {0: RankPlace(4, 5, now, "sending bucket 3"), 1: RankPlace(3, 40, now - 100, "done"), 2: None}
    report = push_report(4, places, {0: True, 1: True, 2: False})
    assert report.startswith("policy rank(s) [2] did not write their stacks: stopped or dead")
    assert "policy rank(s) [1, 2] never started push 4" in report
    assert "behind" not in report  # one rank on the push: nobody to be behind


def test_ranks_at_the_same_place_are_not_called_behind():
    now = time.time()
    places = {r: RankPlace(2, 4, now, "sending bucket 1") for r in range(2)}
    assert push_report(2, places, {0: True, 1: True}) == (
        "policy rank 0: sending bucket 1 (for 0 s); policy rank 1: sending bucket 1 (for 0 s)")
