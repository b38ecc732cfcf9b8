"""Deterministic fault injection for the real-run tests: workflow tasks that misbehave on one
MPI rank at one call, chosen by task_args, so no production code carries a test hook.

`HangingGame` is the referential game, except that on world rank `rank` its `where` method
("allowed_tokens", which a replica calls while generating, or "reward", which the
orchestrator calls) stops answering at call number `after`: it sleeps `seconds` (long
enough to count as hung, bounded so that a broken test cannot leave a rank behind forever).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from flexmarl_hpc.workflows.referential import ReferentialGame


class HangingGame(ReferentialGame):
    def __init__(self, turns, where: str = "reward", rank: int = 0, after: int = 1,
                 seconds: float = 300.0, **kw):
        super().__init__(turns, **kw)
        self.where, self.rank, self.after, self.seconds = where, rank, after, seconds
        self.calls = 0
        self.mine = os.environ.get("PMI_RANK") == str(rank)    # set by mpiexec on each rank

    def _maybe_hang(self, where: str) -> None:
        if self.mine and where == self.where:
            self.calls += 1
            if self.calls == self.after:
                time.sleep(self.seconds)

    def allowed_tokens(self, turn):
        self._maybe_hang("allowed_tokens")
        return super().allowed_tokens(turn)

    def reward(self, path):
        self._maybe_hang("reward")
        return super().reward(path)


class PreemptingGame(ReferentialGame):
    """The referential game whose orchestrator (world rank 0) sends itself SIGUSR1, Slurm's
    preemption signal, at reward call number `after`: a preemption at a fixed point in the
    middle of a step instead of wherever a timed signal lands. `marker` (a file) makes it
    happen once: the resumed run, which must use the same workflow, runs to the end."""

    def __init__(self, turns, after: int = 1, marker: str = "", **kw):
        super().__init__(turns, **kw)
        self.after, self.marker, self.calls = after, Path(marker), 0
        self.mine = os.environ.get("PMI_RANK") == "0" and bool(marker) and not self.marker.exists()

    def reward(self, path):
        if self.mine:
            self.calls += 1
            if self.calls == self.after:
                self.marker.write_text(f"SIGUSR1 at reward call {self.after}\n")
                os.kill(os.getpid(), signal.SIGUSR1)
        return super().reward(path)


class NoHeldoutGame(ReferentialGame):
    """The referential game without held-out inputs (run.eval_every must refuse it)."""
    from flexmarl_hpc.workflows.base import Task as _Task
    heldout_inputs = _Task.heldout_inputs


class DividingGame(ReferentialGame):
    """A user task with a bug in its constructor (it divides by zero)."""

    def __init__(self, turns, **kw):
        super().__init__(turns, **kw)
        self.ratio = len(self.objects) / 0
