"""Waiting without spinning, and without MPI: a back-off sleep between looks, or a sleep in a
doorbell (comm.py says why we never spin). No mpi4py here, nor in what this imports: vLLM's TP
workers wait with it too (deadline.wait_works), and they are processes spawned by a replica
rank, in whose environment importing mpi4py aborts the process (PMI_Init, exit 15).

    until(lambda: work.is_completed(), timeout=5.0, what="a bucket")
"""
from __future__ import annotations

from typing import Callable

from flexmarl_hpc.clock import REAL
from flexmarl_hpc.runtime.doorbell import GRACE_S, SAFETY_S, Doorbell

MIN_SLEEP, MAX_SLEEP = 2e-5, 5e-4


class Backoff:
    def __init__(self) -> None:
        self.delay = MIN_SLEEP

    def sleep(self) -> None:
        REAL.sleep(self.delay)
        self.delay = min(self.delay * 2, MAX_SLEEP)


def until(ready: Callable[[], bool], timeout: float | None = None, bell: Doorbell | None = None,
          may_sleep: Callable[[], bool] | None = None, what: str = "nothing ready") -> None:
    """Return once `ready()`; between looks, sleep in `bell` (woken by a ring, then poll for
    its GRACE_S) or, without one, with back-off. TimeoutError after `timeout` seconds."""
    b = Backoff()
    t0 = REAL.monotonic()
    woke = -float("inf")
    while not ready():
        now = REAL.monotonic()
        if timeout is not None and now - t0 > timeout:
            raise TimeoutError(f"{what} in {timeout} s")
        if bell is not None and now - woke >= GRACE_S and (may_sleep is None or may_sleep()):
            if bell.sleep(SAFETY_S if timeout is None else min(SAFETY_S, t0 + timeout - now)):
                woke, b = REAL.monotonic(), Backoff()     # rung: the message is on its way
        else:
            b.sleep()
