"""Where each agent's trainer state starts (agent-centric allocation): read by the trainer
ranks that build it and by the orchestrator that tracks it; pure, MPI- and torch-free.
"""
from __future__ import annotations

from collections.abc import Sequence

from flexmarl_hpc.config.resources import Group
from flexmarl_hpc.runtime.messages import Location


def initial_placement(groups: Sequence[Group], agents: Sequence[str]) -> dict[str, Location]:
    """Where each of `agents` starts: on its trainer group (the plan's `groups`,
    config/plan.py; the uniform case puts agent i on group i % G), resident for the group's
    first agent, parked in that group's host memory for the others (agent-centric
    allocation)."""
    at = {agent: Location(g, resident=i == 0) for g, grp in enumerate(groups)
          for i, agent in enumerate(grp.agents)}
    return {agent: at[agent] for agent in agents}
