"""The math_team dataset: generated problems are deterministic, disjoint between train and
eval, and each answer is the value of the problem's own expression over its own numbers.

    pytest tests/unit/test_wordproblems.py
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter

import pytest

from flexmarl_hpc.workflows.wordproblems import TEMPLATES, evaluate, operations, train_and_eval
from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "make_math_team_data.py"


def run_script(out, *args):
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, text=True,
                       capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return [[json.loads(line) for line in (out / f"{n}.jsonl").read_text().splitlines()] for n in ("train", "eval")]


def test_the_script_is_deterministic_and_writes_the_generated_problems(tmp_path):
    a = run_script(tmp_path / "a", "--train", "300", "--eval", "100")
    b = run_script(tmp_path / "b", "--train", "300", "--eval", "100")
    c = run_script(tmp_path / "c", "--train", "300", "--eval", "100", "--seed", "1")
    assert a == b != c
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    train, heldout = train_and_eval(0, 300, 100, max_steps=2)            # the script's default
    assert a == [[p.row() for p in train], [p.row() for p in heldout]]
    assert {r["steps"] for rows in a for r in rows} == {1, 2}
    assert run_script(tmp_path / "d", "--train", "300", "--eval", "100", "--max-steps", "4") == \
        [[p.row() for p in part] for part in train_and_eval(0, 300, 100)]
    assert set(a[0][0]) == {"question", "answer", "steps"} and not list((tmp_path / "a").glob("*.tmp"))


def test_default_sizes_are_disjoint_and_distinct():
    train, heldout = train_and_eval(0, 2000, 300)
    assert (len(train), len(heldout)) == (2000, 300)
    questions = [p.question for p in train]
    assert len(set(questions)) == 2000 and len({p.question for p in heldout}) == 300
    assert not set(questions) & {p.question for p in heldout}


def test_each_answer_is_its_own_expression_over_its_own_numbers():
    train, heldout = train_and_eval(3, 1000, 200)
    for p in train + heldout:
        assert isinstance(p.answer, int) and p.answer > 0
        assert evaluate(p.expression) == p.answer and p.steps == operations(p.expression)
        in_question = Counter(re.findall(r"\d+", p.question))
        for number in set(re.findall(r"\d+", p.expression)):
            assert number in in_question, (number, p)          # no number the text does not give
        assert set(re.findall(r"\d+", p.question)) <= set(re.findall(r"\d+", p.expression)), p


def test_hand_checked_problems():
    """The first held-out problems of seed 0, solved by hand (also pins the generator: a change
    to it changes the dataset and must be deliberate)."""
    _, heldout = train_and_eval(0, 2000, 300)
    assert [p.row() for p in heldout[:3]] == [
        {"question": "A pump fills a tank with 8 liters per minute for 8 minutes, then with 4 liters "
                     "per minute for 2 minutes. How many liters are in the tank?", "answer": 72, "steps": 3},
        {"question": "Isla has 9 apples and shares them equally among 3 friends. How many apples does "
                     "each friend get?", "answer": 3, "steps": 1},
        {"question": "Noah has 13 cookies and gives away 8. How many cookies does Noah have left?",
         "answer": 5, "steps": 1}]


HAND_SOLVED = {  # each template's first problem from Random(42), its question read and solved by hand
    "shop1": 12, "share1": 6, "rate1": 8, "age1": 7,         # 2*6, 12/2, 2*4, 2+5
    "more1": 8, "less1": 2,                                  # 2+6, 8-6
    "shop2": 38, "share2": 4, "rate2": 72, "age2": 19,       # 50-2*6, 2*8/4, 2*12*3, 7*2+5
    "shop3": 24, "share3": 1, "rate3": 36, "age3": 13,       # 3*5+3*3, (2*6-8)/4, 3*2+6*5, 6*2-2+3
    "shop4": 26, "share4": 8, "rate4": 32, "age4": 30}       # 50-15-9, (20-2)/2-1, 12+10+10, 10+20


def test_every_template_against_a_hand_solved_problem():
    """The expression is the answer's definition; this checks it says what the question asks."""
    got = {}
    for templates in TEMPLATES.values():
        for t in templates:
            question, expression = t(random.Random(42))
            got[t.__name__] = evaluate(expression)
    assert got == HAND_SOLVED


def test_the_mix_has_easy_and_multi_step_problems_of_every_theme():
    train, _ = train_and_eval(0, 2000, 300)
    steps = Counter(p.steps for p in train)
    assert set(steps) == {1, 2, 3, 4} and steps[1] >= 0.3 * len(train) and steps[4] >= 0.05 * len(train)
    for k, templates in TEMPLATES.items():
        themes = {t.__name__.rstrip("1234") for t in templates}
        assert {"shop", "share", "rate", "age"} <= themes, k


@pytest.mark.parametrize("bad", ["2 ** 3", "__import__('os')", "1.5 * 2", "x + 1", "-(3)"])
def test_evaluate_accepts_only_integer_arithmetic(bad):
    with pytest.raises((ValueError, SyntaxError)):
        evaluate(bad)
