"""Level-1 load balancing over several rollout pools: each pool re-binds its own replicas,
among the agents it may serve, with its own scheduler.Binder (pure, like scheduler.py).

A replica never leaves its pool: a pool holds replicas of one size class (a 32B pool's
replicas have the GPUs a 32B model needs), so moving one to an agent of another pool
would not fit. Level 2 (which replica gets a request) and weight sync need nothing
pool-specific: they already act on the replicas bound to an agent, in whichever pool.

    pb = PoolBinding([([0, 1], ["a"], s0), ([2, 3, 4], ["b", "c"], s1)])
    binding = pb.initial_binding()          # replica -> agent, over all pools
    new = pb.rebind(backlog, binding)       # None: keep
"""
from __future__ import annotations

from flexmarl_hpc.orchestrator.scheduler import Binder


class PoolBinding:
    def __init__(self, pools: list[tuple[list[int], list[str], Binder]]) -> None:
        """pools: (replica numbers, agents it may serve, its binder) per pool."""
        self.pools = pools
        self.size = sum(len(idx) for idx, _, _ in pools)

    @property
    def wants_servable(self) -> bool:
        """Does some pool's binder read `servable` (Binder.wants_servable)?"""
        return any(binder.wants_servable for _, _, binder in self.pools)

    def initial_binding(self) -> list[str]:
        out: list[str | None] = [None] * self.size
        for idx, _, sched in self.pools:
            for i, agent in zip(idx, sched.initial_binding()):
                out[i] = agent
        return out

    def rebind(self, backlog: dict[str, float], binding: list[str], idle: list[bool] | None = None,
               servable: list[set[str]] | None = None) -> list[str] | None:
        """Each pool re-binds its replicas from its agents' backlog; None if no pool changed.
        `idle`/`servable` (per replica, over all pools) enable the schedulers' time-sharing."""
        new, changed = list(binding), False
        for idx, agents, sched in self.pools:
            mine = set(agents)                   # once per pool, not per replica
            sub = sched.rebind({agent: backlog[agent] for agent in agents}, [binding[i] for i in idx],
                               None if idle is None else [idle[i] for i in idx],
                               None if servable is None else [servable[i] & mine for i in idx])
            if sub is not None:
                changed = True
                for i, agent in zip(idx, sub):
                    new[i] = agent
        return new if changed else None


def pool_binding(plan) -> PoolBinding:
    """The run's pools, each with its binder (every config without rollout.pools: one pool of
    every replica, serving every agent)."""
    return PoolBinding([(plan.layout.pool_replicas(i), list(pool.agents),
                         Binder.for_run(plan.cfg, pool.agents, pool.replicas))
                        for i, pool in enumerate(plan.pools)])
