"""How many cores other processes took from a command of ours while it ran, and which runs
of a set of repetitions to reject as outliers.

A real run on a shared machine is slowed by whatever else runs there. The simulator can
carry that load (`Efficiency.external_cores`: the ranks share `shared_cores` minus it), so a
run is measured with the load it had: the machine's busy CPU time (`/proc/stat`, steal
included: a VM's stolen time is capacity someone else used) minus the run's own (getrusage
of the waited-for children, the ranks included), per second of wall time. What is not
captured: load that changes inside one run (only the run's mean is known), and processes
that only used cores the run left idle, which count as load although they took nothing from
it (the estimate then errs towards a slower machine).

`reject_outliers` is the rule for repetitions: each run's error against its own prediction
(log of measured / predicted, the prediction at that run's load), a run rejected when it is
more than `k` scaled median absolute deviations from the median error of its repetitions.
The model's error is common to the repetitions of one config, so a run that disagrees with
its siblings disagrees by what the load model missed.

    with HostLoad.measure() as load:
        subprocess.run(...)
    load.external_cores, load.own_cores
"""
from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""Of /proc/stat's cpu line (user nice system idle iowait irq softirq steal ...): the busy
ones, steal included (guest time is already inside user)."""
MAD_SCALE = 1.4826
"""The median absolute deviation times this estimates a normal sample's standard deviation."""
MIN_CORES = 0.05
"""The fewest cores a run is assumed to have had (a fully loaded machine still ran it)."""


def busy_seconds(stat_text: str, ticks_per_s: float) -> float:
    """CPU seconds all cores spent busy since boot, from /proc/stat's text."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(x) for x in parts[1:]]
            return sum(values[i] for i in BUSY_FIELDS if i < len(values)) / ticks_per_s
    raise ValueError("/proc/stat: no aggregate 'cpu' line")


def children_cpu_s() -> float:
    """User + system seconds of this process's waited-for descendants."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        return busy_seconds(f.read(), float(os.sysconf("SC_CLK_TCK")))


@dataclass
class HostLoad:
    """The load a command ran under (filled when `measure`'s block ends)."""
    wall_s: float = 0.0
    own_cores: float = 0.0
    """The command's own CPU seconds per wall second (its ranks' mean cores)."""
    external_cores: float = 0.0
    """Everything else's busy CPU seconds per wall second (>= 0)."""
    loadavg: float = 0.0
    """The 1-minute load average at the end (for the report; it counts our ranks too)."""

    @classmethod
    @contextmanager
    def measure(cls):
        load = cls()
        busy0, own0, t0 = machine_busy_s(), children_cpu_s(), time.monotonic()
        try:
            yield load
        finally:
            load.fill(machine_busy_s() - busy0, children_cpu_s() - own0, time.monotonic() - t0)

    def fill(self, busy_s: float, own_s: float, wall_s: float) -> None:
        self.wall_s = wall_s
        self.own_cores = own_s / max(wall_s, 1e-9)
        self.external_cores = max(busy_s - own_s, 0.0) / max(wall_s, 1e-9)
        self.loadavg = os.getloadavg()[0]

    def available(self, cores: float) -> float:
        """The cores this command had: `cores` less the others' load, at least what it used."""
        return max(cores - self.external_cores, self.own_cores, MIN_CORES)


def reject_outliers(errors, k: float = 3.0, floor: float = 0.05) -> np.ndarray:
    """Mask of the runs kept: |e - median(e)| <= k x max(MAD_SCALE x MAD, floor), where e are
    the runs' log errors (log measured / predicted); `floor` keeps a set of near-equal runs
    from rejecting a run a few percent off."""
    e = np.asarray(errors, dtype=np.float64)
    if e.ndim != 1 or not len(e):
        raise ValueError(f"errors: expected a non-empty 1-d sequence, got shape {e.shape}")
    dev = np.abs(e - np.median(e))
    return dev <= k * max(MAD_SCALE * float(np.median(dev)), floor)
