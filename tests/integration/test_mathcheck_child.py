"""Answer checking off the main thread: math-verify's SIGALRM timeout cannot run there, so the
check goes to a child process (workflows/mathcheck.py), which answers within its bound and
is killed and replaced when it does not. The in-process checks: tests/unit/test_mathcheck.py.

    pytest tests/integration/test_mathcheck_child.py
"""
from __future__ import annotations

import threading
import time

from flexmarl_hpc.workflows import mathcheck
from flexmarl_hpc.workflows.mathcheck import answer_correct
from tests.helpers import PATHOLOGICAL


def test_from_another_thread_it_runs_in_a_child_and_still_times_out(math_verify):
    """math-verify's SIGALRM timeout raises ValueError outside the main thread; the check goes
    to a child process instead and answers, right or wrong, within its bound."""
    results = {}

    def work():
        t = time.monotonic()
        results["slow"] = answer_correct(PATHOLOGICAL, 2, timeout_s=1)
        results["slow_s"] = time.monotonic() - t
        results["ok"] = answer_correct("\\boxed{\\sqrt{4}}", 2, timeout_s=1)
        results["wrong"] = answer_correct("\\boxed{\\sqrt{5}}", 2, timeout_s=1)
    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=mathcheck.CHILD_START_S + 60)
    assert not th.is_alive()
    assert results["slow"] is False and results["ok"] is True and results["wrong"] is False
    assert results["slow_s"] < mathcheck.CHILD_START_S + 4


def _stuck(answer, gold, timeout_s):
    """Stands for math-verify caught in C code, where SIGALRM never runs: no answer at all."""
    time.sleep(3600)


def test_a_child_that_does_not_answer_is_killed_and_replaced(math_verify, monkeypatch):
    results = {}

    def work():
        mathcheck._started_child()                    # started and warm before the clock runs
        monkeypatch.setattr(mathcheck, "_math_verify", _stuck)
        t = time.monotonic()
        results["stuck"] = mathcheck._in_child("1", "1", timeout_s=1)
        results["stuck_s"] = time.monotonic() - t
        monkeypatch.undo()
        results["after"] = answer_correct("\\boxed{\\sqrt{4}}", 2, timeout_s=1)
    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=mathcheck.CHILD_START_S + 60)
    assert not th.is_alive()
    assert results["stuck"] is False and 4 <= results["stuck_s"] < 30   # 3 x 1 s + 1 s, then killed
    assert results["after"] is True                                     # a new child answers
