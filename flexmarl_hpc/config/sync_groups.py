"""Which weight-sync groups a job makes at start: one per (trainer group, rollout pool).

A group holds the trainer group's PP-stage senders and every replica of the pool, so any
sync of an agent from that trainer group to any subset of the pool's replicas runs inside
it (runtime/sync_channels.py: point to point along a chain of the sync's targets, see
docs/backends.md#weight-sync): the number of communicators is fixed by the layout, never by
the replica subsets the load balancer produces. Pure (no MPI, no torch):

    for g in plan.sync_groups: print(g.group, g.pool, g.members)     # config/plan.py
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexmarl_hpc.config.layout import RankLayout
from flexmarl_hpc.config.resources import Group, Pool, swap_peers


@dataclass(frozen=True)
class SyncGroup:
    group: int
    """Trainer group index."""
    pool: int
    """Rollout pool index."""
    senders: tuple[int, ...]
    """World ranks of the trainer group's PP-stage senders, stage order (stage 0's is the
    group's leader, which also sends the plan)."""
    replicas: tuple[int, ...]
    """World ranks of every replica of the pool."""
    agents: tuple[str, ...] = ()
    """Agents this pair can carry: the pool serves them and they may live on the group."""

    @property
    def members(self) -> tuple[int, ...]:
        return self.senders + self.replicas

    @property
    def leader(self) -> int:
        return self.senders[0]


def stage_senders(first: int, ranks: int, pipeline_parallel: int) -> tuple[int, ...]:
    """World ranks of each PP stage's sender (TP rank 0 of data-parallel replica 0) of a group
    whose ranks start at `first`: megatron orders ranks tp fastest, then dp, then pp, so stage
    s starts at s x ranks/PP (the trainer checks this against its own ranks at every sync)."""
    per = ranks // pipeline_parallel
    return tuple(first + s * per for s in range(pipeline_parallel))


def sync_groups(pools: Sequence[Pool], groups: Sequence[Group], layout: RankLayout) -> list[SyncGroup]:
    """Every (trainer group, pool) pair that can carry an agent, in a fixed order (every rank
    makes its groups in this order: no two ranks wait for each other's next one). Called
    once, by config/plan.resolve: ranks read `Plan.sync_groups`."""
    out = []
    for g, grp in enumerate(groups):
        resident = {a for h in swap_peers(groups, g) for a in groups[h].agents}
        pp = grp.pipeline_parallel if grp.backend == "megatron" else 1
        senders = stage_senders(layout.group_leader(g), len(layout.group_ranks(g)), pp)
        for p, pool in enumerate(pools):
            agents = tuple(a for a in pool.agents if a in resident)
            if agents:
                out.append(SyncGroup(g, p, senders, tuple(1 + r for r in layout.pool_replicas(p)), agents))
    return out
