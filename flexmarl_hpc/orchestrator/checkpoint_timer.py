"""When an agent's checkpoint is due: every run.checkpoint_every steps, or run.checkpoint_minutes
after its last one, on the run's clock (a simulation's is simulated). The last step is not
due here: the run checkpoints every agent at its end anyway.
"""
from __future__ import annotations

from typing import Callable

from flexmarl_hpc.config.schema import RunConfig


class CheckpointTimer:
    def __init__(self, run: RunConfig, agents: list[str], time: Callable[[], float]) -> None:
        self.run, self.time = run, time
        self.last = {agent: time() for agent in agents}

    def due(self, finished: list[tuple[str, int]]) -> list[str]:
        """The agents of `finished` (agent, version) whose checkpoint is due; their clocks
        restart now."""
        due = [agent for agent, version in finished if self._due(agent, version)]
        for agent in due:
            self.last[agent] = self.time()
        return due

    def _due(self, agent: str, version: int) -> bool:
        if version >= self.run.steps:
            return False
        by_steps = self.run.checkpoint_every > 0 and version % self.run.checkpoint_every == 0
        by_time = 0 < self.run.checkpoint_minutes * 60 <= self.time() - self.last[agent]
        return by_steps or by_time
