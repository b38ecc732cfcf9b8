"""Grade-school word problems with integer answers, generated from a seed (no download):
the dataset of configs/math_team.yaml (scripts/make_math_team_data.py writes it).

    problems = generate(seed=0, n=2000)      # [Problem(question, answer, steps, expression)]

Each template draws its numbers, writes the question and the arithmetic expression that
solves it (e.g. "(3 * 4) + (2 * 5)"); the answer is that expression's exact value, and
`steps` its number of operations (1 to 4). Numbers are drawn so that every division is
exact and every intermediate and final value is a positive integer. The four themes
(shopping, sharing, rates, ages) each have templates of 1 to 4 steps; STEP_WEIGHTS mixes
them so that a small instruct model solves the 1-step ones often enough to learn from.
"""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

NAMES = ("Ava", "Ben", "Chloe", "David", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Lena",
         "Mia", "Noah", "Omar", "Priya", "Sam", "Tara", "Yuki", "Zoe", "Leo")
ITEMS = ("pencils", "apples", "notebooks", "stickers", "oranges", "erasers", "cookies", "cards",
         "balloons", "markers")
STEP_WEIGHTS = {1: 0.4, 2: 0.3, 3: 0.2, 4: 0.1}
"""Share of problems with 1, 2, 3 and 4 operations."""


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    steps: int
    expression: str
    """The arithmetic (+ - * / over the question's numbers) whose value is `answer`."""
    template: str = ""
    """The name of the template function that wrote it (e.g. `shop1`)."""

    def row(self) -> dict:
        """The JSONL line: question, answer, steps."""
        return {"question": self.question, "answer": self.answer, "steps": self.steps}


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def evaluate(expression: str) -> Fraction:
    """The exact value of an expression of integers and + - * / (nothing else is accepted)."""
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        raise ValueError(f"not allowed in a problem's expression: {ast.dump(node)}")
    return ev(ast.parse(expression, mode="eval").body)


def operations(expression: str) -> int:
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(ast.parse(expression, mode="eval")))


# ---------------------------------------------------------------------------------------
# Templates: r -> (question, expression). Numbers stay small: SmolLM2-135M-Instruct solved 8% of
# 1-step problems with two-digit numbers greedily and 29% with one-digit ones (docs/LOG.md).
# ---------------------------------------------------------------------------------------
def _who(r: random.Random, k: int = 1) -> list[str]:
    return r.sample(NAMES, k)


def shop1(r):
    n, a, p, item = *_who(r), r.randint(2, 9), r.randint(2, 9), r.choice(ITEMS)
    return f"{n} buys {a} {item}. Each one costs {p} dollars. How many dollars does {n} spend?", f"{a} * {p}"


def share1(r):
    n, k, each, item = *_who(r), r.randint(2, 5), r.randint(2, 9), r.choice(ITEMS)
    return (f"{n} has {k * each} {item} and shares them equally among {k} friends. "
            f"How many {item} does each friend get?", f"{k * each} / {k}")


def rate1(r):
    v, s, h = r.choice(("snail", "turtle", "robot", "toy car", "duck")), r.randint(2, 9), r.randint(2, 5)
    return f"A {v} moves {s} meters each minute. How many meters does it move in {h} minutes?", f"{s} * {h}"


def age1(r):
    n, a, b = *_who(r), r.randint(2, 12), r.randint(1, 9)
    return f"{n} is {a} years old. How old will {n} be in {b} years?", f"{a} + {b}"


def more1(r):
    n, a, b, item = *_who(r), r.randint(2, 9), r.randint(2, 9), r.choice(ITEMS)
    return f"{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?", f"{a} + {b}"


def less1(r):
    n, a, b, item = *_who(r), r.randint(2, 9), r.randint(2, 9), r.choice(ITEMS)
    return f"{n} has {a + b} {item} and gives away {b}. How many {item} does {n} have left?", f"{a + b} - {b}"


def shop2(r):
    n, a, p, item = *_who(r), r.randint(2, 6), r.randint(2, 9), r.choice(ITEMS)
    m = r.choice((50, 100)) if a * p < 50 else 100      # the change is positive
    return (f"{n} buys {a} {item} that cost {p} dollars each and pays with a {m} dollar bill. "
            f"How many dollars of change does {n} get?", f"{m} - {a} * {p}")


def share2(r):
    n, bags, k = *_who(r), r.randint(2, 6), r.choice((2, 3, 4))
    per = k * r.randint(1, 3)                           # the candies split exactly
    return (f"{n} has {bags} bags with {per} candies in each bag. {n} shares all the candies equally "
            f"among {k} children. How many candies does each child get?", f"{bags} * {per} / {k}")


def rate2(r):
    n, h, w, d = *_who(r), r.randint(2, 8), r.randint(8, 15), r.randint(2, 6)
    return (f"{n} works {h} hours a day and earns {w} dollars an hour. How many dollars does {n} "
            f"earn in {d} days?", f"{h} * {w} * {d}")


def age2(r):
    a, b = _who(r, 2)
    x, k, y = r.randint(3, 12), r.randint(2, 4), r.randint(2, 10)
    return (f"{a} is {x} years old. {b} is {k} times as old as {a}. How old will {b} be in {y} years?",
            f"{x} * {k} + {y}")


def shop3(r):
    n, (i1, i2) = _who(r)[0], r.sample(ITEMS, 2)
    a, p, b, q = r.randint(2, 6), r.randint(2, 9), r.randint(2, 6), r.randint(2, 9)
    return (f"{n} buys {a} {i1} at {p} dollars each and {b} {i2} at {q} dollars each. "
            f"How many dollars does {n} spend in all?", f"{a} * {p} + {b} * {q}")


def share3(r):
    t, c, k = r.randint(2, 5), r.choice((6, 8, 10, 12)), r.randint(2, 5)
    left = r.randint(1, (t * c - 1) // k) * k           # what remains splits exactly into k boxes
    sold = t * c - left
    return (f"A baker makes {t} trays of {c} muffins. {sold} muffins are sold. The rest are packed "
            f"equally into {k} boxes. How many muffins are in each box?", f"({t} * {c} - {sold}) / {k}")


def rate3(r):
    r1, m1, r2, m2 = r.randint(2, 9), r.randint(2, 9), r.randint(2, 9), r.randint(2, 9)
    return (f"A pump fills a tank with {r1} liters per minute for {m1} minutes, then with {r2} liters "
            f"per minute for {m2} minutes. How many liters are in the tank?", f"{r1} * {m1} + {r2} * {m2}")


def age3(r):
    a, b, c = _who(r, 3)
    x, k, d, y = r.randint(3, 12), r.randint(2, 4), r.randint(1, 5), r.randint(2, 10)
    return (f"{a} is {x} years old. {b} is {k} times as old as {a}. {c} is {d} years younger than "
            f"{b}. How old will {c} be in {y} years?", f"{x} * {k} - {d} + {y}")


def shop4(r):
    n, (i1, i2) = _who(r)[0], r.sample(ITEMS, 2)
    a, p, b, q = r.randint(2, 5), r.randint(2, 9), r.randint(2, 5), r.randint(2, 9)
    m = r.choice((50, 100)) if a * p + b * q < 50 else 100
    return (f"{n} has {m} dollars, buys {a} {i1} at {p} dollars each and {b} {i2} at {q} dollars "
            f"each. How many dollars does {n} have left?", f"{m} - {a} * {p} - {b} * {q}")


def share4(r):
    n, bags, per, eaten, k = *_who(r), r.randint(2, 5), r.randint(8, 12), r.randint(1, 5), r.randint(2, 4)
    total = bags * per - eaten
    eaten += total % k                                  # the rest splits exactly
    return (f"{n} has {bags} boxes of {per} crackers, eats {eaten} of them and shares the rest "
            f"equally among {k} friends. Each friend then eats 1 cracker. How many crackers does each "
            f"friend have left?", f"({bags} * {per} - {eaten}) / {k} - 1")


def rate4(r):
    n, s1, h1, s2, h2 = *_who(r), r.randint(3, 9), r.randint(2, 4), r.randint(3, 9), r.randint(2, 4)
    return (f"{n} walks {s1} miles per hour for {h1} hours and runs {s2} miles per hour for {h2} hours, "
            f"then takes a bus for 10 more miles. How many miles does {n} travel?",
            f"{s1} * {h1} + {s2} * {h2} + 10")


def age4(r):
    a, b, c = _who(r, 3)
    x, d = r.randint(4, 12), r.randint(2, 8)
    return (f"{a} is {x} years old. {b} is {d} years older than {a}. {c} is 2 times as old as {b}. "
            f"What is the sum of the ages of {b} and {c}?", f"{x} + {d} + 2 * ({x} + {d})")


TEMPLATES: dict[int, tuple[Callable, ...]] = {
    1: (shop1, share1, rate1, age1, more1, less1), 2: (shop2, share2, rate2, age2),
    3: (shop3, share3, rate3, age3), 4: (shop4, share4, rate4, age4)}


HELDOUT_TEMPLATES = frozenset({"share1", "age1", "less1", "share2", "age2", "share3", "age3", "share4", "age4"})
"""The templates only a held-out set of `split_by_template` uses (about half of each step count)."""


def template_names(steps: int, heldout: bool | None = None) -> tuple[str, ...]:
    """Names of the templates of `steps` operations: all (None), the held-out ones, or the rest."""
    return tuple(t.__name__ for t in TEMPLATES[steps]
                 if heldout is None or (t.__name__ in HELDOUT_TEMPLATES) == heldout)


def numbers(question: str) -> tuple[int, ...]:
    """The integers a question states, in order (a problem's numbers, without its names)."""
    return tuple(int(x) for x in re.findall(r"\d+", question))


def draw(r: random.Random, max_steps: int = 4, heldout: bool | None = None) -> Problem:
    """One problem of 1..max_steps operations, in STEP_WEIGHTS' proportions among those;
    heldout: from the held-out templates only (True), the others only (False), or any (None)."""
    kinds = [k for k in STEP_WEIGHTS if k <= max_steps]
    steps = r.choices(kinds, weights=[STEP_WEIGHTS[k] for k in kinds])[0]
    pool = TEMPLATES[steps] if heldout is None else \
        tuple(t for t in TEMPLATES[steps] if (t.__name__ in HELDOUT_TEMPLATES) == heldout)
    template = r.choice(pool)
    question, expression = template(r)
    value = evaluate(expression)
    assert value.denominator == 1 and value > 0, (expression, value)   # templates keep this
    return Problem(question, int(value), operations(expression), expression, template.__name__)


def generate(seed: int, n: int, exclude: set[str] = frozenset(), stream: str = "train",
             max_steps: int = 4, heldout: bool | None = None,
             exclude_numbers: set[tuple[int, ...]] = frozenset()) -> list[Problem]:
    """n distinct problems of at most `max_steps` operations from (seed, stream), none whose
    question is in `exclude` nor whose numbers are in `exclude_numbers`; heldout: as `draw`."""
    if max_steps not in STEP_WEIGHTS:
        raise ValueError(f"max_steps: expected one of {sorted(STEP_WEIGHTS)}, got {max_steps}")
    r = random.Random(f"math_team/{stream}/{seed}")
    seen, out = set(exclude), []
    for _ in range(200 * n):
        p = draw(r, max_steps, heldout)
        if p.question not in seen and numbers(p.question) not in exclude_numbers:
            seen.add(p.question)
            out.append(p)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} distinct problems after {200 * n} draws; ask for fewer than {n}")


def train_and_eval(seed: int, n_train: int, n_eval: int,
                   max_steps: int = 4) -> tuple[list[Problem], list[Problem]]:
    """Disjoint sets: no eval question is a train question."""
    train = generate(seed, n_train, stream="train", max_steps=max_steps)
    return train, generate(seed, n_eval, {p.question for p in train}, stream="eval", max_steps=max_steps)


def split_by_template(seed: int, n_train: int, n_eval: int,
                      max_steps: int = 4) -> tuple[list[Problem], list[Problem]]:
    """Held-out problems disjoint from training by construction: written by templates training
    never uses (HELDOUT_TEMPLATES), and none states the same numbers, in the same order, as
    any training problem (so no held-out problem is a training one reworded)."""
    train = generate(seed, n_train, stream="train", max_steps=max_steps, heldout=False)
    return train, generate(seed, n_eval, stream="heldout", max_steps=max_steps, heldout=True,
                           exclude_numbers={numbers(p.question) for p in train})
