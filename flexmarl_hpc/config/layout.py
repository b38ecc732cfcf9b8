"""Rank layout: which MPI rank plays which role. Pure arithmetic, unit-tested.

World ranks are laid out in het-job component order, so the same numbering holds under
`mpiexec` and under one het step over components 0-2 (where SLURM_PROCID counts across
components):

    rank 0                      orchestrator
    ranks 1 .. R                rollout replicas, pool after pool
    then the trainer groups     group after group (TP x PP x DP ranks each)
    then the tool ranks         tools.ranks > 0: tool calls and reward functions (last component)

Heterogeneous configs (flexmarl_hpc.config.resources) give pools and groups their own sizes and
each its own het component; the uniform case is 3 components.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

ORCHESTRATOR, ROLLOUT, TRAINER, TOOLS = "orchestrator", "rollout", "trainer", "tools"
ROLES = (ORCHESTRATOR, ROLLOUT, TRAINER, TOOLS)


@dataclass(frozen=True)
class RankLayout:
    replicas: int
    """Rollout replica ranks (all pools)."""
    groups: int
    """Trainer groups."""
    ranks_per_group: int
    """Ranks in each trainer group (0 when the groups differ: see group_sizes)."""
    pool_sizes: tuple[int, ...] = ()
    """Replicas per rollout pool, in rank order (default: one pool of `replicas`)."""
    group_sizes: tuple[int, ...] = ()
    """Ranks per trainer group, in rank order (default: `groups` x `ranks_per_group`)."""
    split_pools: bool = False
    """Each pool is its own het component (else one rollout component)."""
    split_groups: bool = False
    """Each trainer group is its own het component (else one trainer component)."""
    tool_ranks: int = 0
    """Tool ranks (tools.ranks): one het component after the trainers; 0: none (the
    orchestrator runs tools in a local process pool)."""

    def __post_init__(self) -> None:
        if not self.pool_sizes:
            object.__setattr__(self, "pool_sizes", (self.replicas,))
        if not self.group_sizes:
            object.__setattr__(self, "group_sizes", (self.ranks_per_group,) * self.groups)
        if (self.replicas < 1 or self.groups < 1 or min(self.pool_sizes + self.group_sizes) < 1
                or sum(self.pool_sizes) != self.replicas or len(self.group_sizes) != self.groups
                or self.tool_ranks < 0):
            raise ValueError(f"layout needs >= 1 replica, group and rank per group: {self}")

    @classmethod
    def of(cls, pool_sizes, group_sizes, split_pools: bool = True, split_groups: bool = True,
           tool_ranks: int = 0) -> "RankLayout":
        """Pools and groups of any sizes (flexmarl_hpc.config.resources)."""
        g = tuple(group_sizes)
        return cls(sum(pool_sizes), len(g), g[0] if len(set(g)) == 1 else 0, tuple(pool_sizes), g,
                   split_pools, split_groups, tool_ranks)

    @property
    def world_size(self) -> int:
        return 1 + self.replicas + sum(self.group_sizes) + self.tool_ranks

    @property
    def workers(self) -> int:
        """Replica and trainer ranks: the ranks whose busy time is the run's utilization."""
        return self.replicas + sum(self.group_sizes)

    @property
    def component_sizes(self) -> tuple[int, ...]:
        """Tasks per het-job component (orchestrator, rollout pool(s), trainer group(s), tools)."""
        pools = self.pool_sizes if self.split_pools else (self.replicas,)
        groups = self.group_sizes if self.split_groups else (sum(self.group_sizes),)
        return (1, *pools, *groups, *((self.tool_ranks,) if self.tool_ranks else ()))

    @property
    def tool_rank_list(self) -> list[int]:
        """World ranks of the tool ranks (the last ones)."""
        return list(range(1 + self.workers, self.world_size))

    @property
    def orchestrator_rank(self) -> int:
        return 0

    @property
    def replica_ranks(self) -> list[int]:
        return list(range(1, 1 + self.replicas))

    def pool_of(self, replica: int) -> int:
        """The pool of replica number `replica` (0-based over all pools)."""
        return bisect.bisect_right(list(itertools.accumulate(self.pool_sizes)), replica)

    def pool_replicas(self, pool: int) -> list[int]:
        """Replica numbers (0-based) of pool `pool`."""
        first = sum(self.pool_sizes[:pool])
        return list(range(first, first + self.pool_sizes[pool]))

    def group_ranks(self, group: int) -> list[int]:
        if not 0 <= group < self.groups:
            raise ValueError(f"no trainer group {group} (have {self.groups})")
        first = 1 + self.replicas + sum(self.group_sizes[:group])
        return list(range(first, first + self.group_sizes[group]))

    def group_leader(self, group: int) -> int:
        return self.group_ranks(group)[0]

    def role_of(self, rank: int) -> tuple[str, int]:
        """(role, index): index is the replica number or the trainer group number."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        if rank == 0:
            return ORCHESTRATOR, 0
        if rank <= self.replicas:
            return ROLLOUT, rank - 1
        if rank > self.workers:
            return TOOLS, rank - 1 - self.workers
        ends = list(itertools.accumulate(self.group_sizes))
        return TRAINER, bisect.bisect_right(ends, rank - 1 - self.replicas)

    def split_color(self, rank: int) -> int:
        """Color for COMM_WORLD.Split: 0 orchestrator, 1 rollout pool, 2+g trainer group g,
        2+groups the tool ranks."""
        role, idx = self.role_of(rank)
        return {ORCHESTRATOR: 0, ROLLOUT: 1, TOOLS: 2 + self.groups}.get(role, 2 + idx)


def check_world(layout: RankLayout, world_size: int) -> None:
    """Refuse a job whose rank count does not match the layout, naming both numbers."""
    if world_size != layout.world_size:
        raise ValueError(
            f"the job has {world_size} ranks but the config needs {layout.world_size} "
            + (f"(1 orchestrator + {layout.replicas} rollout.replicas + {layout.groups} trainer "
               f"groups x {layout.ranks_per_group} trainer.ranks_per_group)" if layout.ranks_per_group else
               f"(1 orchestrator + {layout.replicas} replicas + trainer groups of "
               f"{'+'.join(map(str, layout.group_sizes))} ranks)")
            + (f" + {layout.tool_ranks} tools.ranks" if layout.tool_ranks else ""))
