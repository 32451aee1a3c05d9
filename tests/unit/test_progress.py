"""What a user sees while waiting (megarl/progress.py): a long wait says what it waits for, at
first after NOTE_FIRST_S and then at most every NOTE_EVERY_S, the same on a terminal and a pipe;
a short one stays silent. The seconds come from a clock of the test's own."""

from __future__ import annotations

import logging
import threading
import time

from megarl import progress
from megarl.progress import WaitNotes, counting, still_waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _notes(what="saving checkpoint step 20") -> tuple[WaitNotes, Clock, list[str]]:
    clock, said = Clock(), []
    return WaitNotes(what, first_s=5, every_s=10, clock=clock, say=said.append), clock, said


def test_a_long_wait_says_what_it_waits_for_first_after_a_while_then_every_interval():
    notes, clock, said = _notes()
    for seconds in (0, 1, 4.9):
        clock.now = 100 + seconds
        notes.tick()
    assert said == []  # a short wait is silent
    for seconds in (5, 6, 14.9, 15, 16, 25.5):
        clock.now = 100 + seconds
        notes.tick()
    assert said == ["saving checkpoint step 20 ... (5 s)", "saving checkpoint step 20 ... (15 s)",
                    "saving checkpoint step 20 ... (26 s)"]  # fmt: skip
    notes.end()
    assert said[-1] == "saving checkpoint step 20: done in 26 s"


def test_a_short_wait_says_nothing_at_its_end_either():
    notes, clock, said = _notes()
    clock.now += 3
    notes.tick()
    notes.end()
    assert said == []


def test_a_count_that_advanced_puts_off_the_next_line():
    count = {"done": 0}
    notes, clock, said = _notes(lambda: f"generating: {count['done']}/30 prompts")
    clock.now += 8
    count["done"] = 10
    notes.said_now()  # its owner printed "generating: 10/30 prompts"
    clock.now += 9.9
    notes.tick()
    assert said == []
    clock.now += 0.1
    notes.tick()
    assert said == ["generating: 10/30 prompts ... (18 s)"]


def test_still_waiting_ticks_in_a_thread_and_ends_with_the_time_taken(caplog):
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        with still_waiting("starting Ray", first_s=0.05, every_s=0.05):
            deadline = time.monotonic() + 60
            while not any("starting Ray ..." in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no progress line"
                time.sleep(0.01)
        with still_waiting("a quick one"):  # over before the first line is due
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("starting Ray ... (") and lines[0].endswith(" s)")
    assert lines[-1].startswith("starting Ray: done in ")
    assert not any("a quick one" in line for line in lines)
    assert not any(t.name == "megarl-wait-notes" for t in threading.enumerate())


def test_a_failed_wait_leaves_its_ending_to_the_error(caplog):
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        try:
            with still_waiting("loading checkpoint", first_s=0.01, every_s=10) as notes:
                while not notes.said:
                    time.sleep(0.01)
                raise RuntimeError("broken")
        except RuntimeError:
            pass
    assert not any("done in" in r.getMessage() for r in caplog.records)


def test_counting_on_a_pipe_logs_slow_advances_and_a_line_between_them(caplog, monkeypatch):
    monkeypatch.setattr(progress, "NOTE_EVERY_S", 0.05)  # pytest's stdout is no terminal: the pipe's form
    monkeypatch.setattr(progress, "NOTE_FIRST_S", 0.0)  # every advance is "slow"
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        with counting(30, "generating", "prompts", done=10) as advance:
            advance(10)
            deadline = time.monotonic() + 60
            while not any(r.getMessage().startswith("generating: 20/30 prompts ... (") for r in caplog.records):
                assert time.monotonic() < deadline, "no line while the batch is slow"
                time.sleep(0.01)
            advance(10)
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if " ... (" not in line] == ["generating: 20/30 prompts", "generating: 30/30 prompts"]


def test_counting_on_a_pipe_is_no_flood_of_quick_advances(caplog):
    """25 chunks scored in a blink (a built-in scorer): the last count, not 25 lines."""
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        with counting(25 * 1024, "scoring", "responses") as advance:
            for _ in range(25):
                advance(1024)
    assert [r.getMessage() for r in caplog.records] == ["scoring: 25600/25600 responses"]


def test_nothing_to_say_yet_is_no_line():
    """A count not written yet (a conversion's tensors before rank 0's first count): no line."""
    count: dict[str, str] = {"text": ""}
    notes, clock, said = _notes(lambda: count["text"])
    clock.now += 30
    notes.tick()
    assert said == [] and notes.said == 0
    count["text"] = "megatron-to-hf: exporting: 12/290 tensors"
    notes.tick()
    assert said == ["megatron-to-hf: exporting: 12/290 tensors ... (30 s)"]


def test_counting_on_a_pipe_says_the_last_count_once(caplog):
    """A caller whose callback told every sample, then advances by what is left (0): one last line."""
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        with counting(12, "scoring", "responses") as advance:
            advance(12)
            advance(0)
    assert [r.getMessage() for r in caplog.records] == ["scoring: 12/12 responses"]


def test_a_line_about_a_wait_inside_another_puts_off_the_outer_ones_line():
    # "checking the config and its files ... (N s)" every 10 s interleaved with "importing
    # reward.custom from FILE ... (N s)" every 5 s: two streams for one wait.
    with still_waiting("outer", first_s=3600, every_s=3600) as outer, still_waiting("inner", first_s=3600, every_s=3600) as inner:
        due = outer.next = inner.next = time.monotonic() + 1000  # never due while the test runs: no tick moves them
        progress.said_inside(threading.get_ident(), inner)  # the inner wait said a line
        assert outer.next > due and inner.next == due
        other = threading.Thread(target=progress.said_inside)  # another thread's waits are not these
        other.start()
        other.join()
        assert inner.next == due
        progress.said_inside()  # a line said in this thread (the import check's): every wait of it
        assert inner.next > due
    assert progress._ACTIVE == []


def test_the_inner_waits_own_line_puts_off_the_outer_one():
    with still_waiting("outer", first_s=3600, every_s=3600) as outer:
        due = outer.next = time.monotonic() + 1000
        with still_waiting("inner", first_s=0.01, every_s=3600) as inner:
            deadline = time.monotonic() + 60
            while not inner.said and time.monotonic() < deadline:
                time.sleep(0.01)
        assert inner.said == 1 and outer.next > due  # put off: due every_s (3600 s) after the inner line
