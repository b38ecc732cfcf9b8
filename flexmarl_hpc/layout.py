"""Rank layout: which MPI rank plays which role. Pure arithmetic, unit-tested.

World ranks are laid out in het-job component order, so the same numbering holds under
`mpiexec` and under one het step over components 0-2 (where SLURM_PROCID counts across
components):

    rank 0                      orchestrator
    ranks 1 .. R                rollout replicas
    then G groups of T ranks    trainer groups (group g: data-parallel ranks of one agent slot)
"""
from __future__ import annotations

from dataclasses import dataclass

ORCHESTRATOR, ROLLOUT, TRAINER = "orchestrator", "rollout", "trainer"
ROLES = (ORCHESTRATOR, ROLLOUT, TRAINER)


@dataclass(frozen=True)
class RankLayout:
    replicas: int
    """Rollout replica ranks."""
    groups: int
    """Trainer groups."""
    ranks_per_group: int
    """Ranks in each trainer group."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.groups < 1 or self.ranks_per_group < 1:
            raise ValueError(f"layout needs >= 1 replica, group and rank per group: {self}")

    @property
    def world_size(self) -> int:
        return 1 + self.replicas + self.groups * self.ranks_per_group

    @property
    def component_sizes(self) -> tuple[int, int, int]:
        """Tasks per het-job component (orchestrator, rollout pool, trainers)."""
        return 1, self.replicas, self.groups * self.ranks_per_group

    @property
    def orchestrator_rank(self) -> int:
        return 0

    @property
    def replica_ranks(self) -> list[int]:
        return list(range(1, 1 + self.replicas))

    def group_ranks(self, group: int) -> list[int]:
        if not 0 <= group < self.groups:
            raise ValueError(f"no trainer group {group} (have {self.groups})")
        first = 1 + self.replicas + group * self.ranks_per_group
        return list(range(first, first + self.ranks_per_group))

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
        return TRAINER, (rank - 1 - self.replicas) // self.ranks_per_group

    def split_color(self, rank: int) -> int:
        """Color for COMM_WORLD.Split: 0 orchestrator, 1 rollout pool, 2+g trainer group g."""
        role, idx = self.role_of(rank)
        return {ORCHESTRATOR: 0, ROLLOUT: 1}.get(role, 2 + idx)


def layout_from_config(cfg) -> RankLayout:
    return RankLayout(cfg.rollout.replicas, cfg.num_trainer_groups, cfg.trainer.ranks_per_group)


def check_world(layout: RankLayout, world_size: int) -> None:
    """Refuse a job whose rank count does not match the layout, naming both numbers."""
    if world_size != layout.world_size:
        raise ValueError(
            f"the job has {world_size} ranks but the config needs {layout.world_size} "
            f"(1 orchestrator + {layout.replicas} rollout.replicas + {layout.groups} trainer "
            f"groups x {layout.ranks_per_group} trainer.ranks_per_group)")
