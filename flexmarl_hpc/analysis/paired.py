"""Paired comparisons of 0/1 scores on the same held-out inputs (scripts/eval_heldout.py,
scripts/team_experiment.py): the exact two-sided sign test over the flips."""
from __future__ import annotations

import math


def sign_test(up: int, down: int) -> float:
    """P(a split at least this uneven | each flip is a fair coin): inputs turned wrong ->
    right (`up`) against right -> wrong (`down`), ties left out. No scipy needed: the
    binomial sum is exact."""
    n, k = up + down, min(up, down)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
