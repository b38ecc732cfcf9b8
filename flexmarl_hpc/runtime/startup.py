"""Start-up in two phases with their own deadlines, each measured on every rank.

    secs = started(world, live, "build", built_s, cfg.run.build_timeout_s, t0)    # collective
    ... open the weight-sync communicators (deadline run.comm_setup_timeout_s)
    secs = started(world, live, "comm", comm_s, cfg.run.comm_setup_timeout_s, t1)

"build": every rank has built its engine (vLLM: load, compile, CUDA graphs) or trainer;
"comm": every weight-sync communicator is set up (config/sync_groups.py, in order). Each
phase gathers every rank's own seconds (the orchestrator logs the slowest, `report`), and a
rank still waiting past its phase's deadline ends the job (exit 1) naming the field. Before,
these shared each sync group's weight_sync.timeout_s: the first group's deadline covered the
engines' build, and a later group's every earlier group's set-up (issue 36).
"""
from __future__ import annotations

import statistics
import sys
from typing import Callable

import numpy as np

from flexmarl_hpc.clock import REAL

FIELDS = {"build": "run.build_timeout_s", "comm": "run.comm_setup_timeout_s"}
WHAT = {"build": "engines and trainers built", "comm": "weight-sync communicators set up"}


class StartupTimeout(RuntimeError):
    """A start-up phase passed its deadline on this rank."""


def report(phase: str, seconds: list[float], who: Callable[[int], str]) -> str:
    """The train.log line of a phase: its slowest rank and the median of the others' seconds
    (ranks that do nothing in it, the orchestrator's 0, left out of the median)."""
    slow = max(range(len(seconds)), key=seconds.__getitem__)
    busy = [s for s in seconds if s > 0] or [0.0]
    return (f"start-up: {WHAT[phase]} in {seconds[slow]:.1f} s (slowest: {who(slow)}, rank {slow}; median "
            f"{statistics.median(busy):.1f} s over {len(busy)} ranks; {FIELDS[phase]} bounds it)")


def started(world, live, phase: str, mine: float, timeout_s: float, since: float,
            log: Callable[[str], None] | None = None, who: Callable[[int], str] = str,
            preempted: Callable[[], bool] = lambda: False) -> list[float]:
    """Collective: wait (no spin) until every rank is through `phase`, by `since +
    timeout_s` (REAL.monotonic() of this rank's phase start); returns every rank's `mine`
    (its own seconds in the phase). Rank 0 (`log`) writes the phase's line and watches the
    liveness star: a worker that ends meanwhile ends the job with 75, and so does a
    preemption signal (`preempted()`: SIGTERM, SIGUSR1) while a rank is still building, which
    would otherwise wait out the deadline (a hung rank: no step to drain, nothing trained since
    the checkpoints). Past the deadline: StartupTimeout on this rank."""
    from flexmarl_hpc.runtime.comm import until
    send = np.array([mine], dtype=np.float64)
    got = np.zeros(world.Get_size(), dtype=np.float64)
    req, lost = world.Iallgather(send, got), []

    def ready() -> bool:
        if req.Test():
            return True
        if log is not None and live is not None:
            lost.extend(r for r in [live.take_lost()] if r is not None)
        if log is not None and preempted():
            _preempted(world, log, phase)
        if REAL.monotonic() > since + timeout_s:
            raise StartupTimeout(f"start-up: not every rank had {WHAT[phase]} {REAL.monotonic() - since:.0f} s "
                                 f"after the phase began ({FIELDS[phase]}={timeout_s:g}; this rank's own part: "
                                 f"{mine:.1f} s)")
        return bool(lost)

    until(ready)
    if lost:
        _lost(world, log, lost[0])
    out = [float(x) for x in got]
    if log is not None:
        log(report(phase, out, who))
    return out


def _preempted(world, log, phase: str) -> None:
    from flexmarl_hpc.runtime import requeue
    from flexmarl_hpc.runtime.comm import abort
    log(f"preemption signal during start-up (not every rank had {WHAT[phase]}): nothing trained since "
        f"the checkpoints; exiting {requeue.EXIT_REQUEUE} to requeue")
    requeue.mark(f"a preemption signal during start-up ({phase})")
    abort(world, requeue.EXIT_REQUEUE)


def _lost(world, log, rank: int) -> None:
    from flexmarl_hpc.runtime import requeue
    from flexmarl_hpc.runtime.requeue import EXIT_REQUEUE
    from flexmarl_hpc.runtime.comm import abort
    log(f"rank {rank}: its process ended before the run started (liveness socket closed); "
        f"exiting {EXIT_REQUEUE} to requeue")
    requeue.mark(f"rank {rank} was lost before the run started")
    abort(world, EXIT_REQUEUE)


def timed_out(world, e: Exception, log: Callable[[str], None] | None = None) -> int:
    """A start-up deadline passed (StartupTimeout, or a communicator set-up's
    CollectiveTimeout): one line, the job ends with 1 (a requeue would start as slowly)."""
    from flexmarl_hpc.runtime.comm import abort
    line = f"[rank {world.Get_rank()}] {e}; raise the field or look at the slow rank's log"
    (log or (lambda s: sys.stderr.write(s + "\n")))(line)
    sys.stderr.flush()
    abort(world, 1)
    return 1
