"""The ranks' clocks (the orchestrator's and a worker's), and the deadlines of the commands it waits on.

`WorkerClock` books a worker's commands and the waits between them.

`BusyClock` books rank 0's time by activity (schedule, handle, store, log; the gaps are
`wait`) as the same (activity, agent, t0, t1) intervals the workers report, so the
orchestrator is a row of the timeline like every other rank. Activities nest (a store
write inside `handle`): the inner one is cut out of the outer, so intervals never overlap.

Each takes the run's clock (flexmarl_hpc.clock: the machine's in a job, the simulated one in
a simulation), except `Watchdog`, which guards this process against a real hang.

`Deadlines` knows, per worker rank, the commands sent and not yet answered. Workers run
their commands in arrival order, so only the oldest one of a rank is running: its clock
starts when it was sent or when the rank answered the one before, whichever is later.
"""
from __future__ import annotations

from collections import defaultdict, deque
from contextlib import contextmanager

from flexmarl_hpc.clock import REAL, Clock


class WorkerClock:
    """A worker rank's clock: collects the (activity, agent, t0, t1) intervals of the commands it
    runs, the gaps between them booked as 'wait'; they travel to the orchestrator with each reply.
    Flat, unlike BusyClock: a worker does one command at a time."""

    def __init__(self, clock: Clock = REAL) -> None:
        self.items: list[tuple[str, str, float, float]] = []
        self.source = clock
        self.last = clock.time()

    def now(self) -> float:
        return self.source.time()

    def mark(self, activity: str, agent: str, t0: float) -> None:
        t1 = self.source.time()
        # a gap is waiting (for the next command); one under 0.1 ms is not worth a row: a
        # coarser cut leaves back-to-back micro-batches' gaps unbooked
        if t0 - self.last > 1e-4:
            self.items.append(("wait", "", self.last, t0))
        self.items.append((activity, agent, t0, t1))
        self.last = t1

    def waited(self, t0: float) -> float:
        """Book everything since the last activity as waiting (for the command that arrived at
        t0, then for the other members of a collective); returns now."""
        now = self.source.time()
        self.items.append(("wait", "", min(self.last, t0), now))
        self.last = now
        return now

    def drain(self) -> list[tuple[str, str, float, float]]:
        out, self.items = self.items, []
        return out


class BusyClock:
    """The orchestrator's clock: `with clock("handle"):` books nested activities (see above)."""

    def __init__(self, clock: Clock = REAL) -> None:
        self.items: list[tuple[str, str, float, float]] = []
        self.busy: dict[str, float] = defaultdict(float)     # seconds by activity, since reset
        self.stack: list[str] = []
        self.source = clock
        self.t = clock.time()

    @contextmanager
    def __call__(self, activity: str):
        now = self.source.time()
        self._book(self.stack[-1] if self.stack else "wait", now)
        self.stack.append(activity)
        try:
            yield
        finally:
            self._book(self.stack.pop(), self.source.time())

    def _book(self, activity: str, now: float) -> None:
        start, self.t = self.t, now
        if now <= start:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last[0] == activity and start - last[3] < 1e-4:
            self.items[-1] = (activity, "", last[2], now)      # continue the same bar
        else:
            self.items.append((activity, "", start, now))
        if activity != "wait":
            self.busy[activity] += now - start

    def drain(self) -> list[tuple[str, str, float, float]]:
        out, self.items = self.items, []
        return out

    def take_busy(self) -> float:
        """Busy seconds since the last call."""
        s = sum(self.busy.values())
        self.busy.clear()
        return s


class Deadlines:
    def __init__(self, timeout: float, clock: Clock = REAL) -> None:
        self.timeout, self.clock = timeout, clock
        self.asked: dict[int, deque[str]] = defaultdict(deque)
        self.since: dict[int, float] = {}

    def sent(self, rank: int, what: str) -> None:
        q = self.asked[rank]
        if not q:
            self.since[rank] = self.clock.monotonic()
        q.append(what)

    def answered(self, rank: int) -> None:
        q = self.asked.get(rank)
        if q:
            q.popleft()
            self.since[rank] = self.clock.monotonic()

    def forget(self, rank: int) -> None:
        """Stop timing a rank already reported as hung."""
        self.asked.pop(rank, None)

    def running(self, rank: int) -> str | None:
        """The command `rank` is running (the oldest unanswered), or None."""
        q = self.asked.get(rank)
        return q[0] if q else None

    def next_deadline(self) -> float | None:
        """Seconds until the first running command is overdue (None: nothing outstanding)."""
        starts = [self.since[r] for r, q in self.asked.items() if q]
        return None if not starts else max(min(starts) + self.timeout - self.clock.monotonic(), 0.0)

    def overdue(self) -> tuple[int, str, float] | None:
        """(rank, command, seconds) of the longest-running command past the timeout."""
        now = self.clock.monotonic()
        late = [(now - self.since[r], r, q[0]) for r, q in self.asked.items()
                if q and now - self.since[r] > self.timeout]
        if not late:
            return None
        secs, rank, what = max(late)
        return rank, what, secs


class Watchdog:
    """Bounds a call that runs on rank 0 itself (a reward function): a thread that wakes at
    most once a second (never a spin) and calls `on_hang(what, seconds)` once a call has run
    for longer than `timeout`. `on_hang` runs on that thread and must end the process.
    On the machine's clock in a simulation too: a reward function that hangs hangs this
    process, and simulated time stands still while it runs."""

    def __init__(self, timeout: float, on_hang) -> None:
        import threading
        self.timeout, self.on_hang, self.clock = timeout, on_hang, REAL
        self.current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(min(self.timeout / 4, 1.0)):
            cur = self.current
            if cur is not None and self.clock.monotonic() - cur[1] > self.timeout:
                self.on_hang(cur[0], self.clock.monotonic() - cur[1])
                return

    def close(self) -> None:
        self._stop.set()


class WatchedTask:
    """A task whose reward (and evaluation metric) calls the watchdog times (rank 0 computes them)."""

    def __init__(self, task, watchdog: Watchdog) -> None:
        self._task, self._watchdog = task, watchdog

    def __getattr__(self, name):
        return getattr(self._task, name)

    def reward(self, path):
        self._watchdog.current = ("a reward call", self._watchdog.clock.monotonic())
        try:
            return self._task.reward(path)
        finally:
            self._watchdog.current = None

    def eval_metrics(self, path):
        self._watchdog.current = ("an eval_metrics call", self._watchdog.clock.monotonic())
        try:
            return self._task.eval_metrics(path)
        finally:
            self._watchdog.current = None
