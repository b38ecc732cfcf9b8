"""The answer check's cost per call: answer_correct (exact fractions for plain numbers, the
path every math_team answer takes) vs math-verify alone on the same answers.

    .venv/bin/python bench/bench_mathcheck.py [--reps 5] [--n 300]

The answers are free-form replies to the first --n held-out math_team problems
(workflows/wordproblems.py, seed 0), half right and half off by one, in three forms: "The
answer is N.", "\\boxed{N}" and "#### N". Both paths must give the same verdicts (checked).
math-verify runs in this (main) thread with its SIGALRM timeout, as in a reward worker.
Interleaved A/B `--reps` times after one untimed pair; prints microseconds per call, median
[min, max], and the ratio of medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexmarl_hpc.workflows.mathcheck import answer_correct, extract_answer, verify_text
from flexmarl_hpc.workflows.wordproblems import train_and_eval

FORMS = ("The answer is {}.", "So the total is \\boxed{{{}}}", "5 + 7 = 12\n#### {}")


def cases(n: int) -> list[tuple[str, int, bool]]:
    _, heldout = train_and_eval(0, 2000, n)
    out = []
    for i, p in enumerate(heldout):
        right = i % 2 == 0
        out.append((FORMS[i % 3].format(p.answer if right else p.answer + 1), p.answer, right))
    return out


def timed(check, items) -> float:
    t0 = time.perf_counter()
    for text, gold, right in items:
        assert check(text, gold) == right, (text, gold, right)
    return (time.perf_counter() - t0) / len(items) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    items = cases(args.n)
    paths = {"answer_correct": answer_correct,
             "math-verify": lambda text, gold: verify_text(extract_answer(text), str(gold))}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(args.reps + 1):                    # rep 0: untimed (imports, caches)
        for name, check in paths.items():
            us = timed(check, items)
            if rep:
                times[name].append(us)
    print(f"answer check, {len(items)} answers (half right), {args.reps} interleaved reps after 1 untimed")
    for name, ts in times.items():
        print(f"  {name:15s}: {statistics.median(ts):10.1f} us/call  [{min(ts):.1f}, {max(ts):.1f}]")
    ratios = [b / a for a, b in zip(times["answer_correct"], times["math-verify"])]
    print(f"  ratio math-verify/answer_correct: {statistics.median(ratios):.0f} [{min(ratios):.0f}, {max(ratios):.0f}]")


if __name__ == "__main__":
    main()
