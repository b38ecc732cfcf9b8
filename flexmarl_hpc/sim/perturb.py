"""Per-operation jitter, injected stragglers, and a node failure with restart from checkpoint.

Jitter and stragglers scale a worker command's modelled duration by a factor drawn from
numpy's Generator seeded by (seed, rank, the rank's operation count): the same seed gives
the same run, whatever else the run does, and a different seed another draw.
- jitter: lognormal with mean 1 (exp(sigma z - sigma^2 / 2));
- stragglers: each operation, with `straggler_prob`, takes `straggler_factor` times longer;
- slow ranks: a seeded `slow_ranks` fraction of the worker ranks is `slow_factor` slower
  for the whole run (a degraded device, a thermally throttled node).

A node failure is applied to a simulated timeline (the step end times): the work since the
last checkpoint is lost, the job restarts after `restart_s` (detection, requeue, start-up)
plus the time to read the checkpoint back, and redoes the lost steps at their durations.
The orchestrator is not re-run: the steps after a restart cost what they cost before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Perturbation:
    """Seeded noise on the modelled durations (all off by default)."""

    seed: int = 0
    """Seed of every draw."""
    jitter_sigma: float = 0.0
    """Lognormal sigma of each operation's duration factor (mean 1); 0: none."""
    straggler_prob: float = 0.0
    """Chance that one operation is a straggler."""
    straggler_factor: float = 1.0
    """A straggling operation's duration factor."""
    slow_ranks: float = 0.0
    """Fraction of worker ranks that are slow for the whole run."""
    slow_factor: float = 1.0
    """A slow rank's duration factor."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("jitter_sigma", 0, 5), ("straggler_prob", 0, 1), ("slow_ranks", 0, 1),
                             ("straggler_factor", 1, math.inf), ("slow_factor", 1, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"perturbation: field {name!r}: expected a number in [{lo}, {hi}], got {v!r}")

    @property
    def active(self) -> bool:
        return bool(self.jitter_sigma or (self.straggler_prob and self.straggler_factor > 1)
                    or (self.slow_ranks and self.slow_factor > 1))


class Perturber:
    """The factors of one run's operations: `factor(rank)` for the rank's next operation."""

    def __init__(self, p: Perturbation, world: int) -> None:
        self.p = p
        slow = np.random.default_rng([p.seed, 0x51]).random(world) < p.slow_ranks
        slow[0] = False                       # the orchestrator is not a worker
        self.slow = {int(r) for r in np.nonzero(slow)[0]}
        self.count: dict[int, int] = {}

    def factor(self, rank: int) -> float:
        n = self.count.get(rank, 0)
        self.count[rank] = n + 1
        rng = np.random.default_rng([self.p.seed, rank, n])
        z, u = rng.standard_normal(), rng.random()
        s = self.p.jitter_sigma
        f = math.exp(s * z - s * s / 2)
        if u < self.p.straggler_prob:
            f *= self.p.straggler_factor
        return f * (self.p.slow_factor if rank in self.slow else 1.0)


@dataclass(frozen=True)
class Failure:
    """One node failure during a run."""

    at_s: float
    """Seconds after the run's start when the node fails."""
    restart_s: float = 300.0
    """Seconds from the failure to the restarted job's first step (detection by the
    heartbeat, Slurm requeue, MPI start-up, model construction): an assumption."""
    load_s: float = 0.0
    """Seconds to read the checkpoint back (its bytes / the file system's bandwidth)."""


def with_failure(step_ends, checkpoint_every: int, failure: Failure) -> np.ndarray:
    """Step end times (seconds from the start) once `failure` strikes: steps that ended by the
    last checkpoint at or before it are kept, the run resumes from that checkpoint at
    at_s + restart_s + load_s and redoes every later step with its original duration.
    `checkpoint_every` 0: no checkpoint, the run restarts from scratch."""
    ends = np.asarray(step_ends, dtype=np.float64)
    if failure.at_s >= ends[-1] if len(ends) else True:
        return ends.copy()
    done = int(np.searchsorted(ends, failure.at_s, side="right"))      # steps complete at the failure
    kept = (done // checkpoint_every) * checkpoint_every if checkpoint_every > 0 else 0
    durations = np.diff(np.r_[0.0, ends])
    resume = failure.at_s + failure.restart_s + failure.load_s
    return np.r_[ends[:kept], resume + np.cumsum(durations[kept:])]


def checkpoint_load_s(state_bytes: float, filesystem_gb_s: float) -> float:
    """Seconds to read `state_bytes` of checkpoint at `filesystem_gb_s` (GB/s, decimal)."""
    if filesystem_gb_s <= 0:
        raise ValueError(f"filesystem_gb_s: expected > 0, got {filesystem_gb_s!r}")
    return state_bytes / (filesystem_gb_s * 1e9)
