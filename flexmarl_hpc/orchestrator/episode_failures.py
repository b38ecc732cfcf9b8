"""Failed episodes of a run (issue 40): what train.log says about them and when the run stops.

An episode that raises (or returns no usable reward) is a failure of the kind of its
exception (its type name). The log gets the first failure of each kind in full (its
traceback), then one line per step that had failures, with a count per kind. A step in which
more than `workflow.max_failure_rate` of the episodes failed stops the run
(orchestrator/failures.py `stop_failing`): a run whose episode function is broken must not
train on for hours with every reward 0 and exit 0.

    failures = EpisodeFailures(max_rate=0.5, per_step=24)
    failures.add(step, example_id, episode, error)     # workflows.episode.EpisodeError
    failures.step_done(step)                           # its count line, if it had failures
    failures.take_lines(); failures.stop               # the log's new lines; None or why
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flexmarl_hpc.workflows.episode import EpisodeError


@dataclass
class EpisodeFailures:
    max_rate: float
    """workflow.max_failure_rate: a step with more than this share of failed episodes stops the run."""
    per_step: int
    """Episodes per step (inputs_per_step x group_size)."""
    counts: dict[int, Counter] = field(default_factory=dict)
    """step -> failure kind -> episodes."""
    first: dict[int, tuple[int, int, EpisodeError]] = field(default_factory=dict)
    """step -> its first failure (example, episode, error)."""
    kinds: set[str] = field(default_factory=set)
    """Kinds already logged in full."""
    lines: list[str] = field(default_factory=list)
    stop: str | None = None
    """Why the run must stop (one line, then the step's first traceback), once it must."""

    def add(self, step: int, example: int, episode: int, err: EpisodeError) -> None:
        counts = self.counts.setdefault(step, Counter())
        counts[err.kind] += 1
        self.first.setdefault(step, (example, episode, err))
        if err.kind not in self.kinds:
            self.kinds.add(err.kind)
            self.lines.append(f"episode failed (first {err.kind}): step {step}, example {example}, "
                              f"episode {episode}: {one_line(err)}\n{err.traceback.rstrip()}")
        n = sum(counts.values())
        if self.stop is None and n > self.max_rate * self.per_step:
            ex, ep, e = self.first[step]
            self.stop = (f"stopping the run: {n} of the {self.per_step} episodes of step {step} failed "
                         f"({by_kind(counts)}), more than workflow.max_failure_rate={self.max_rate:g}; "
                         f"first (example {ex}, episode {ep}): {one_line(e)}\n{e.traceback.rstrip()}")

    def step_done(self, step: int) -> None:
        """All of `step`'s episodes ended: a line with its failures by kind, if it had any."""
        counts = self.counts.get(step)
        if counts:
            self.lines.append(f"step {step}: {sum(counts.values())} of {self.per_step} episodes "
                              f"failed ({by_kind(counts)})")

    def take_lines(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def one_line(err: EpisodeError) -> str:
    return f"{err.kind}: {' '.join(err.message.split())}"[:300]


def by_kind(counts: Counter) -> str:
    return ", ".join(f"{k} {n}" for k, n in counts.most_common())
