"""sim.perturb: seeded jitter and stragglers, and a node failure's restart-from-checkpoint
cost on a timeline worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from flexmarl_hpc.sim.perturb import Failure, Perturbation, Perturber, checkpoint_load_s, with_failure


def draws(p: Perturbation, rank: int = 3, n: int = 2000) -> np.ndarray:
    pert = Perturber(p, 8)
    return np.array([pert.factor(rank) for _ in range(n)])


def test_jitter_is_seeded_deterministic_and_has_mean_one():
    p = Perturbation(seed=7, jitter_sigma=0.3)
    a, b = draws(p), draws(p)
    assert (a == b).all()                                   # same seed, same run
    assert not (a == draws(Perturbation(seed=8, jitter_sigma=0.3))).all()
    assert a.mean() == pytest.approx(1.0, abs=0.03) and a.std() > 0.2
    assert (draws(Perturbation()) == 1.0).all()             # off by default


def test_stragglers_take_their_factor_with_their_probability():
    f = draws(Perturbation(seed=1, straggler_prob=0.1, straggler_factor=5.0))
    assert set(np.unique(f)) == {1.0, 5.0}
    assert (f == 5.0).mean() == pytest.approx(0.1, abs=0.02)


def test_slow_ranks_are_a_seeded_fraction_of_the_workers_never_the_orchestrator():
    pert = Perturber(Perturbation(seed=2, slow_ranks=0.5, slow_factor=3.0), 1000)
    assert 0 not in pert.slow and 430 < len(pert.slow) < 570
    r = min(pert.slow)
    assert pert.factor(r) == 3.0 and pert.factor(r - 1 if r - 1 not in pert.slow else 0) == 1.0


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="straggler_prob"):
        Perturbation(straggler_prob=1.5)


def test_a_failure_loses_the_steps_since_the_last_checkpoint():
    """Steps of 10 s end at 10..60; checkpoints every 2 steps; a failure at 45 s (4 steps done,
    checkpoint after step 4 kept): restart at 45 + 100 + 5 = 150, steps 5, 6 end at 160, 170.
    At 35 s (3 done, checkpoint after step 2): restart at 140, steps 3..6 end at 150..180."""
    ends = np.arange(10.0, 61.0, 10.0)
    out = with_failure(ends, 2, Failure(at_s=45.0, restart_s=100.0, load_s=5.0))
    assert out.tolist() == [10, 20, 30, 40, 160, 170]
    out = with_failure(ends, 2, Failure(at_s=35.0, restart_s=100.0, load_s=5.0))
    assert out.tolist() == [10, 20, 150, 160, 170, 180]
    assert with_failure(ends, 0, Failure(at_s=35.0, restart_s=0.0)).tolist() == [45, 55, 65, 75, 85, 95]
    assert with_failure(ends, 2, Failure(at_s=99.0)).tolist() == ends.tolist()   # after the run


def test_checkpoint_load_is_bytes_over_the_file_systems_bandwidth():
    assert checkpoint_load_s(30e9, 10.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="filesystem_gb_s"):
        checkpoint_load_s(1, 0)
