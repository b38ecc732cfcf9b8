"""The clock a run's code reads, passed in like its transport: the machine's for a job, the
simulator's for a simulated run.

Whatever stamps the run's timeline (StoreFile, the Orchestrator and its RunRecorder, BusyClock,
WorkerClock, Deadlines) takes a `Clock` when it is built; the simulator builds them with a
`SimulatedClock`, so every timestamp and deadline of a simulated run is simulated time,
whichever of `time()` or `monotonic()` a line reads. Code that waits on something real (a
file lock another process holds, an MPI peer, a hung reward function on this process's
thread) reads `REAL` by name, so that choice is written where it is made.

This module imports nothing of the package: any layer may import it. It is the only module
under the parts the simulator runs (orchestrator/, store/, runtime/) that reads `time`
(tests/unit/test_clock.py scans them).
"""
from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: the timestamps of the run's timeline."""

    def monotonic(self) -> float:
        """Seconds on a clock that never steps back: elapsed times and deadlines."""

    def sleep(self, secs: float) -> None:
        """Let `secs` pass."""


class RealClock:
    """The machine's clock."""

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.monotonic()

    def sleep(self, secs: float) -> None:
        _time.sleep(secs)


REAL = RealClock()
"""The machine's clock: a job's, and that of any wait on something real."""


class SimulatedClock:
    """A simulated run's clock: `source.now` (sim.transport.SimTransport's, seconds since the
    epoch), which only the transport moves. `monotonic()` is the same time, so deadlines run
    on it too; nothing may sleep on it (simulated time passes as the transport delivers)."""

    def __init__(self, source) -> None:
        self.source = source

    def time(self) -> float:
        return self.source.now

    def monotonic(self) -> float:
        return self.source.now

    def sleep(self, secs: float) -> None:
        raise RuntimeError(f"simulation: something tried to sleep {secs:g} s on the simulated clock")
