"""The orchestrator's clock and command deadlines (pure, no MPI)."""
import time

from flexmarl_hpc.runtime.timing import BusyClock, Deadlines, Watchdog


def test_nested_activities_never_overlap_and_gaps_are_waits():
    c = BusyClock()
    time.sleep(0.01)                                   # booked as wait
    with c("handle"):
        time.sleep(0.01)
        with c("store"):                               # cut out of handle
            time.sleep(0.02)
        time.sleep(0.01)
    items = c.drain()
    assert [a for a, *_ in items] == ["wait", "handle", "store", "handle"]
    for (_, _, a0, a1), (_, _, b0, b1) in zip(items, items[1:]):
        assert a1 <= b0 + 1e-9 and a0 < a1
    busy = c.take_busy()
    assert 0.035 < busy < 0.2 and c.take_busy() == 0.0
    assert items[2][3] - items[2][2] >= 0.02


def test_deadline_runs_from_the_previous_answer_of_the_same_rank():
    d = Deadlines(timeout=0.05)
    d.sent(1, "generate batch 1")
    d.sent(1, "generate batch 2")                      # queued behind batch 1
    d.sent(2, "train micro-batch 1")
    assert d.overdue() is None and 0 < d.next_deadline() <= 0.05
    time.sleep(0.03)
    d.answered(1)                                      # batch 2 starts now
    d.answered(2)
    assert d.next_deadline() > 0.03                    # rank 2 has nothing outstanding
    time.sleep(0.06)
    rank, what, secs = d.overdue()
    assert (rank, what) == (1, "generate batch 2") and secs >= 0.05
    d.forget(1)
    assert d.overdue() is None and d.next_deadline() is None


def test_watchdog_reports_a_call_that_runs_too_long_once():
    seen = []
    w = Watchdog(0.2, lambda what, secs: seen.append((what, secs)))
    w.current = ("a reward call", time.monotonic())
    time.sleep(0.6)
    w.close()
    assert len(seen) == 1 and seen[0][0] == "a reward call" and seen[0][1] > 0.2
