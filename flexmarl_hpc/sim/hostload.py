"""How many cores other processes took from a command of ours while it ran, and which runs
of a set of repetitions to reject as outliers.

A real run on a shared machine is slowed by whatever else runs there. The simulator can
carry that load (`Efficiency.external_cores`: the ranks share `shared_cores` minus it), so a
run is measured with the load it had over its timed steps: the machine's busy CPU time
(`/proc/stat`, steal included: a VM's stolen time is capacity someone else used) minus the
run's own (the CPU time of this process's descendants, `/proc/PID/stat`: the launcher and the
ranks), per second of wall time, sampled every 0.2 s so that a run's start-up (most of a short
run's wall time) is left out. What is not captured: load that changes faster than the
window (only its mean is known), and processes that only used cores the run left idle, which
count as load although they took nothing from it (the estimate then errs towards a slower
machine).

`reject_outliers` is the rule for repetitions: each run's error against its own prediction
(log of measured / predicted, the prediction at that run's load), a run rejected when it is
more than `k` scaled median absolute deviations from the median error of its repetitions.
The model's error is common to the repetitions of one config, so a run that disagrees with
its siblings disagrees by what the load model missed.

    with LoadSampler() as sampler:
        subprocess.run(...)
    load = sampler.window(t0, t1)          # the steps' span, epoch seconds
    load.external_cores, load.own_cores
"""
from __future__ import annotations

import os
import threading
import time
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


def pid_stat(text: str) -> tuple[int, int, int]:
    """(parent pid, its own CPU ticks utime + stime, its reaped children's cutime + cstime)
    from /proc/PID/stat's text (the command name may hold blanks and parentheses)."""
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def tree_ticks(stats: dict[int, tuple[int, int, int]], root: int) -> int:
    """CPU ticks of `root`'s descendants, from {pid: pid_stat(...)}: the living ones' own and
    reaped children's, and those `root` itself reaped (not root's own)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = stats[root][2] if root in stats else 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += stats[pid][1] + stats[pid][2]
        todo.extend(children.get(pid, []))
    return total


def read_stats(proc: str = "/proc") -> dict[int, tuple[int, int, int]]:
    out = {}
    for name in os.listdir(proc):
        if name.isdigit():
            try:
                with open(f"{proc}/{name}/stat") as f:
                    out[int(name)] = pid_stat(f.read())
            except (OSError, ValueError, IndexError):     # gone meanwhile
                pass
    return out


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        return busy_seconds(f.read(), float(os.sysconf("SC_CLK_TCK")))


@dataclass
class HostLoad:
    """The load over a window of wall time."""
    wall_s: float = 0.0
    own_cores: float = 0.0
    """The command's own CPU seconds per wall second (its ranks' mean cores)."""
    external_cores: float = 0.0
    """Everything else's busy CPU seconds per wall second (>= 0)."""
    loadavg: float = 0.0
    """The 1-minute load average when it was read (for the report; it counts our ranks too)."""

    def fill(self, busy_s: float, own_s: float, wall_s: float) -> None:
        self.wall_s = wall_s
        self.own_cores = own_s / max(wall_s, 1e-9)
        self.external_cores = max(busy_s - own_s, 0.0) / max(wall_s, 1e-9)
        self.loadavg = os.getloadavg()[0]

    def available(self, cores: float) -> float:
        """The cores this command had: `cores` less the others' load, at least what it used."""
        return max(cores - self.external_cores, self.own_cores, MIN_CORES)


class LoadSampler:
    """Samples (time.time(), the machine's busy CPU seconds, this process's descendants' CPU
    seconds) every `period` s in a thread while its block runs; `window(t0, t1)` is the load
    over any part of that time (a run's timed steps, not its start-up)."""

    def __init__(self, period: float = 0.2) -> None:
        self.period, self.samples = period, []
        self._stop = threading.Event()
        self._tick = float(os.sysconf("SC_CLK_TCK"))

    def sample(self) -> None:
        own = tree_ticks(read_stats(), os.getpid()) / self._tick
        self.samples.append((time.time(), machine_busy_s(), own))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> "LoadSampler":
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def window(self, t0: float, t1: float) -> HostLoad:
        """The load between t0 and t1 (epoch seconds inside the sampled time; linear between
        samples)."""
        t, busy, own = (np.array(x) for x in zip(*self.samples))
        if not (t[0] <= t0 < t1 <= t[-1]):
            raise ValueError(f"window: expected {t[0]:.1f} <= t0 < t1 <= {t[-1]:.1f}, got {t0:.1f}, {t1:.1f}")
        load = HostLoad()
        load.fill(*(float(np.interp(t1, t, x) - np.interp(t0, t, x)) for x in (busy, own)), t1 - t0)
        return load


def reject_outliers(errors, k: float = 3.0, floor: float = 0.05) -> np.ndarray:
    """Mask of the runs kept: |e - median(e)| <= k x max(MAD_SCALE x MAD, floor), where e are
    the runs' log errors (log measured / predicted); `floor` keeps a set of near-equal runs
    from rejecting a run a few percent off."""
    e = np.asarray(errors, dtype=np.float64)
    if e.ndim != 1 or not len(e):
        raise ValueError(f"errors: expected a non-empty 1-d sequence, got shape {e.shape}")
    dev = np.abs(e - np.median(e))
    return dev <= k * max(MAD_SCALE * float(np.median(dev)), floor)
