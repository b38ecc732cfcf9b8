"""Answer checking: the final answer of free-form text, compared by value (exact fractions for
plain numbers, math-verify for the rest), and bounded in time from any thread.

    pytest tests/unit/test_mathcheck.py    # its child process: tests/integration/test_mathcheck_child.py
"""
from __future__ import annotations

import time

import pytest

from flexmarl_hpc.workflows import mathcheck
from flexmarl_hpc.workflows.mathcheck import answer_correct, extract_answer, plain_number
from tests.helpers import PATHOLOGICAL


@pytest.fixture
def no_math_verify(monkeypatch):
    """The plain-number path must decide alone: reaching math-verify fails the test."""
    def refuse(*a, **k):
        raise AssertionError(f"math-verify was called for {a}")
    monkeypatch.setattr(mathcheck, "verify_text", refuse)


@pytest.mark.parametrize("text,want", [
    ("First 3 + 4 = 7, then \\boxed{7} and more \\boxed{\\frac{1}{2}} at last.", "\\frac{1}{2}"),
    ("\\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),          # nested braces
    ("She has 5 apples.\nThe answer is 12.", "12"),
    ("Answer: $1,000$.", "1,000"),
    ("5 + 7 = 12\n#### 12", "12"),
    ("so each one gets 3/4 of it", "3/4"),                          # the last number, a fraction
    ("5 and then 6 and finally -2.5", "-2.5"),
    ("no digits here", None),
    ("an unclosed \\boxed{3 and 4", "4"),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("pred,gold", [
    ("The answer is 1/2", 0.5), ("\\boxed{0.5}", "1/2"), ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("answer: 3.0", 3), ("#### 3", "3.0"), ("Answer: 1,000", 1000), ("\\boxed{1000}", "1,000"),
    ("so 12 dollars in total. Answer: 12 dollars", 12), ("answer: 45%", 45), ("\\boxed{-\\dfrac{6}{4}}", -1.5),
    ("The answer is $12$.", 12), (".5", "0.5"),
])
def test_equal_values_in_different_forms_on_the_fast_path(pred, gold, no_math_verify):
    assert answer_correct(pred, gold)


@pytest.mark.parametrize("pred,gold", [
    ("The answer is 13", 12), ("\\boxed{0.51}", 0.5), ("#### 1,001", 1000), ("answer: -3", 3),
    ("\\boxed{\\frac{1}{3}}", "0.333"), ("12 apples, then 3 more: 15", 12),
])
def test_wrong_answers_are_wrong_on_the_fast_path(pred, gold, no_math_verify):
    assert not answer_correct(pred, gold)


@pytest.mark.parametrize("pred", ["", "I do not know.", "Answer:", None])
def test_no_answer_is_wrong(pred, no_math_verify):
    assert not answer_correct(pred, 3)


def test_require_marker_ignores_a_stray_last_number(no_math_verify):
    cut = "We divide 9 apples among 3 friends. Now we find how many are left over, 3"
    assert answer_correct(cut, 3) and not answer_correct(cut, 3, require_marker=True)
    assert extract_answer(cut, require_marker=True) is None
    assert answer_correct("so 3 each.\nAnswer: 3", 3, require_marker=True)
    assert answer_correct("\\boxed{3}", 3, require_marker=True)


def test_plain_number_is_exact():
    assert plain_number("0.1") + plain_number("0.2") == plain_number("3/10")   # no float rounding
    assert plain_number("1,00") is None and plain_number("1/0") is None and plain_number("x") is None
    assert plain_number("9" * 61) is None                                        # left to math-verify


def test_expressions_go_to_math_verify(math_verify):
    assert answer_correct("The answer is $x^2+2x+1$", "(x+1)^2")
    assert answer_correct("\\boxed{\\sqrt{4}}", 2)
    assert answer_correct("\\boxed{2 \\cdot 6}", 12)
    assert not answer_correct("\\boxed{\\sqrt{5}}", 2)
    assert not answer_correct("The answer is $x^2+1$", "(x+1)^2")




def test_a_pathological_answer_times_out_as_wrong_in_the_main_thread(math_verify):
    t = time.monotonic()
    assert not answer_correct(PATHOLOGICAL, 2, timeout_s=1)
    assert time.monotonic() - t < 20                 # bounded (its timeouts are 3 x 1 s), not hung
    assert answer_correct("\\boxed{\\sqrt{4}}", 2)   # the alarm was cleared and the handler restored
