"""Processor sharing of a machine's cores among the simulated ranks' compute.

A local run has more MPI ranks than cores (6 ranks on 2 here), so while ranks computing
`w` in all share `cores` with `p` others that poll while they wait, each runs at

    1 while w < cores (the pollers wake up on an idle core), else cores / (w + waiting_share x p)

of a core, and every start or end re-times the others still running. A polling rank
(`Iprobe` and back-off sleeps, flexmarl_hpc.runtime.comm) uses little CPU of its own, but each
wake-up preempts a rank that computes (a context switch, caches refilled), which
`bench/bench_cores.py --pollers` measures as a share of a core per waiting rank. Which ranks
poll is the run's `run.idle_wait` (`waiting_pollers`): all that wait with `poll`; with
`doorbell` the workers sleep until rung and only the orchestrator polls (while a command of
its is in flight, which is most of a run). `CoreShare` is that fluid model, pure and exact: jobs
are added with a start time (now or later: a rank's queue) and their work in seconds at a
whole core; `advance(t)` moves its clock to `t` and returns the jobs that completed on the
way, each with its completion time, in order. `sim.transport.SimTransport` uses it for
generate and train commands when a hardware profile sets `shared_cores`; `work_at_rate`
inverts the same model on a real run's intervals for `sim.calibrate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

EPS = 1e-6
"""Seconds of slack for a start "in the past" (times are epoch seconds: ~2e-7 s resolution)."""


@dataclass(eq=False)
class Job:
    """One command's compute."""
    key: Any
    """The caller's handle (the rank that runs it)."""
    start: float
    """When it starts (its rank's previous command has ended and it has arrived)."""
    work: float
    """Seconds it takes at a whole core."""
    weight: int = 1
    """Ranks computing it at once (a trainer group's members)."""
    payload: Any = None
    """Whatever the caller needs back when it completes."""
    done: float = 0.0
    """Seconds of `work` done so far."""


def waiting_pollers(computing, ranks: int, workers_poll: bool = True):
    """Ranks that poll while `computing` ranks compute (scalar or array), `ranks` in all:
    every other one when the workers poll (run.idle_wait=poll), else the orchestrator alone."""
    w = np.asarray(computing, dtype=np.float64)
    p = np.maximum(ranks - w, 0.0) if workers_poll else np.full_like(w, min(ranks, 1))
    return float(p) if p.ndim == 0 else p


def core_rate(computing, cores: float, ranks: int = 0, waiting_share: float = 0.0,
              workers_poll: bool = True):
    """Fraction of a core each of `computing` ranks gets (scalar or array; 1 where none
    computes): `cores` shared with the waiting_pollers, `waiting_share` of a core each."""
    w = np.asarray(computing, dtype=np.float64)
    # while a core is idle the pollers wake up there; once none is, they preempt
    load = np.where(w < cores, w, w + waiting_share * waiting_pollers(w, ranks, workers_poll))
    rate = np.where(w > 0, np.minimum(1.0, cores / np.maximum(load, 1e-300)), 1.0)
    return float(rate) if rate.ndim == 0 else rate


def work_at_rate(t0: np.ndarray, t1: np.ndarray, cores: float, ranks: int = 0,
                 waiting_share: float = 0.0, workers_poll: bool = True) -> np.ndarray:
    """Seconds at a whole core of each compute interval [t0, t1) of a real run: the integral
    of `core_rate` over it, the concurrency counted from the intervals themselves (the
    inverse of CoreShare: a run of these works under that model has these intervals)."""
    t0, t1 = np.asarray(t0, np.float64), np.asarray(t1, np.float64)
    if not len(t0):
        return np.zeros(0)
    times = np.concatenate([t0, t1])
    order = np.argsort(times, kind="stable")
    ts = times[order]
    w = np.cumsum(np.r_[np.ones(len(t0)), -np.ones(len(t1))][order])    # computing after each event
    rate = core_rate(w[:-1], cores, ranks, waiting_share, workers_poll)
    done = np.r_[0.0, np.cumsum(np.diff(ts) * rate)]                   # work of one rank since ts[0]
    return np.interp(t1, ts, done) - np.interp(t0, ts, done)


class CoreShare:
    """Jobs sharing `cores` (with `ranks` in all, those not computing waiting) from time `t` on."""

    def __init__(self, cores: float, t: float, ranks: int = 0, waiting_share: float = 0.0,
                 workers_poll: bool = True) -> None:
        if not cores > 0:          # fractional: what other processes leave of a machine's cores
            raise ValueError(f"cores: expected > 0, got {cores}")
        if waiting_share < 0:
            raise ValueError(f"waiting_share: expected >= 0, got {waiting_share}")
        self.cores, self.t = cores, t
        self.ranks, self.waiting_share, self.workers_poll = ranks, waiting_share, workers_poll
        self.jobs: list[Job] = []

    def add(self, job: Job) -> None:
        if job.start < self.t - EPS:
            raise ValueError(f"a job starting at {job.start} is in the past (the clock is at {self.t})")
        job.start = max(job.start, self.t)
        self.jobs.append(job)

    def rate(self) -> float:
        """Fraction of a core each running job gets now."""
        w = sum(j.weight for j in self.jobs if j.start <= self.t)
        return core_rate(w, self.cores, self.ranks, self.waiting_share, self.workers_poll)

    def _next(self) -> tuple[float, Job | None]:
        """The next event: (time, the job that completes) or (time a pending job starts, None)."""
        rate, end, first = self.rate(), math.inf, None
        for j in self.jobs:
            if j.start <= self.t:
                te = self.t + max(j.work - j.done, 0.0) / rate
                if te < end:
                    end, first = te, j
        start = min((j.start for j in self.jobs if j.start > self.t), default=math.inf)
        return (start, None) if start < end else (end, first)

    def _go(self, t: float) -> None:
        """Run every started job at the current rate up to `t` (no event in between)."""
        rate = self.rate()
        for j in self.jobs:
            if j.start <= self.t:
                j.done += (t - self.t) * rate
        self.t = t

    def advance(self, t: float) -> list[tuple[float, Job]]:
        """Move the clock to `t`; the jobs that complete by then, with their times, in order."""
        out = []
        while self.jobs:
            te, job = self._next()
            if te > t:
                break
            self._go(te)
            if job is not None:
                self.jobs.remove(job)
                out.append((te, job))
        if t > self.t:
            self._go(t)
        return out

    def next_end(self) -> float:
        """When the next job completes if nothing is added meanwhile (inf: none left)."""
        saved = (self.t, [(j, j.done, j.start) for j in self.jobs], list(self.jobs))
        try:
            while self.jobs:
                te, job = self._next()
                if job is not None:
                    return te
                self._go(te)
            return math.inf
        finally:
            self.t, self.jobs = saved[0], saved[2]
            for j, done, start in saved[1]:
                j.done, j.start = done, start
