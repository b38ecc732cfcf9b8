"""Where each agent's trainer state starts (agent-centric allocation): read by the trainer
ranks that build it and by the orchestrator that tracks it; pure, MPI- and torch-free.
"""
from __future__ import annotations

from flexmarl_hpc.config.resources import trainer_groups
from flexmarl_hpc.config.schema import Config
from flexmarl_hpc.runtime.messages import Location


def initial_placement(cfg: Config):
    """Where each agent's state starts: on its trainer group (flexmarl_hpc.config.resources; the
    uniform case puts agent i on group i % G), resident for the group's first agent, parked
    in that group's host memory for the others (agent-centric allocation)."""
    at = {agent: Location(g, resident=i == 0) for g, grp in enumerate(trainer_groups(cfg))
          for i, agent in enumerate(grp.agents)}
    return {agent: at[agent] for agent in cfg.agent_names}
