"""Which device each rank uses: a pure choice from its role and its node-local peers.

On a GPU node every rollout replica and every trainer rank needs GPUs of its own; the
orchestrator needs none. Nothing else decides that: vLLM's single-process executor takes
device 0, and Slurm's SLURM_LOCALID numbers the tasks of one het component on a node (two
components sharing a node both have a task 0; under `--single` it counts the orchestrator
and the replicas too), so left alone every replica of a node lands on GPU 0 and trainer
ranks share GPUs.

    peers = node_peers(world, layout)        # (world rank, role) of every rank on this node
    b = choose_device(rank, peers, {ROLLOUT: gpus_per_replica, TRAINER: 1}, visible_gpus(env))
    apply_binding(b)                         # before any engine or trainer is built

`choose_device` is pure: the GPU ranks of a node take consecutive blocks of the GPUs the
node shows (`width` GPUs each, in world-rank order), so no two ranks share one. A rank's
block is its local rank: its index among the node's GPU ranks, from MPI's shared-memory
split, which sees every rank of the node whatever its component (for a node of trainer
ranks only, with Slurm's block distribution, it equals SLURM_LOCALID).

What the job script asks for (flexmarl_hpc.launch.sbatch): trainer components get
`--gpus-per-node` and srun `--gpu-bind=none`, so each trainer rank sees every GPU of its
node and keeps them visible: NCCL's peer-to-peer (NVLink) paths between the tensor-parallel
ranks of a node need the peers' devices; the rank only sets its own (`torch.cuda.set_device`
to cuda:<its local rank's GPU>). Replica components get `--gpus-per-task` = their width:
Slurm binds each replica to its block, the rank sees exactly `width` GPUs and takes them;
it narrows CUDA_VISIBLE_DEVICES to the block (vLLM then uses cuda:0 .. cuda:width-1, and its
tensor parallelism stays inside the block). Anything else (fewer GPUs than the node's
ranks need) is an error naming the numbers, never a silent share.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from flexmarl_hpc.config.layout import ORCHESTRATOR, ROLLOUT, TOOLS, TRAINER, RankLayout


@dataclass(frozen=True)
class Binding:
    device: str
    """torch device of the rank: 'cpu' or 'cuda:K' (K an index among the GPUs it sees
    after `visible` is applied)."""
    visible: str | None = None
    """Value for CUDA_VISIBLE_DEVICES (replicas: their block), or None: leave it as it is."""
    gpus: tuple[str, ...] = ()
    """The GPUs (ids as the node shows them) this rank owns."""


CPU = Binding("cpu")


def visible_gpus(env: Mapping[str, str]) -> list[str] | None:
    """The GPU ids this process sees, from CUDA_VISIBLE_DEVICES (set by Slurm's gres plugin)
    or else SLURM_STEP_GPUS / SLURM_JOB_GPUS; None when the environment does not say (the
    caller asks CUDA for its device count)."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if var in env:
            text = env[var].strip()
            return [] if text in ("", "-1", "NoDevFiles") else [g.strip() for g in text.split(",")]
    return None


def choose_device(rank: int, peers: Sequence[tuple[int, str]], width: Mapping[str, int],
                  visible: Sequence[str], rank_width: Mapping[int, int] | None = None) -> Binding:
    """The device of world rank `rank`.

    peers: (world rank, role) of every rank on this node, `rank` included.
    width: GPUs per rank of each role (roles not named, e.g. the orchestrator, get none).
    visible: the GPU ids this rank sees (empty: a CPU node).
    rank_width: GPUs of particular ranks, overriding their role's width (replicas of rollout
    pools with different gpus_per_replica).
    """
    roles = dict(peers)
    if rank not in roles:
        raise ValueError(f"rank {rank} is not among its node's ranks {sorted(roles)}")

    def wof(r: int) -> int:
        return rank_width[r] if rank_width and r in rank_width else width.get(roles[r], 0)

    w = wof(rank)
    if w == 0 or not visible:
        return CPU
    gpu_ranks = sorted(r for r, _ in peers if wof(r) > 0)
    need = sum(wof(r) for r in gpu_ranks)
    offset = sum(wof(r) for r in gpu_ranks if r < rank)
    if len(visible) >= need:
        block = tuple(visible[offset:offset + w])
    elif len(visible) == w:                    # Slurm bound this task to its own GPUs
        block = tuple(visible)
    else:
        counts = {role: sum(1 for r in gpu_ranks if roles[r] == role) for role in (ROLLOUT, TRAINER)}
        raise ValueError(
            f"rank {rank} ({roles[rank]}): its node runs {counts[ROLLOUT]} replica(s) x "
            f"{width.get(ROLLOUT, 0)} GPU(s) and {counts[TRAINER]} trainer rank(s) x "
            f"{width.get(TRAINER, 0)} GPU, {need} GPUs in all, but this rank sees {len(visible)} "
            f"({','.join(visible)}); ranks would share GPUs: raise slurm.<component>.gpus_per_node, "
            "spread the ranks over more nodes, or bind one block per task (--gpus-per-task)")
    if roles[rank] == ROLLOUT:
        return Binding("cuda:0", ",".join(block), block)
    return Binding(f"cuda:{list(visible).index(block[0])}", None, block)


def role_widths(layout: RankLayout, gpus_per_replica: int) -> dict[str, int]:
    return {ORCHESTRATOR: 0, ROLLOUT: gpus_per_replica, TRAINER: 1, TOOLS: 0}


def replica_widths(layout: RankLayout, per_pool: Sequence[int]) -> dict[int, int]:
    """World rank -> GPUs of each replica, from its pool's gpus_per_replica."""
    return {r: per_pool[layout.pool_of(r - 1)] for r in layout.replica_ranks}


def node_peers(world, layout: RankLayout) -> list[tuple[int, str]]:
    """(world rank, role) of every rank on this rank's node, from MPI's shared-memory split
    (collective over `world`: every rank calls it)."""
    from mpi4py import MPI
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        ranks = node.allgather(world.Get_rank())
    finally:
        node.Free()
    return [(r, layout.role_of(r)[0]) for r in ranks]


def apply_binding(b: Binding) -> None:
    """Make `b` the process's device, before CUDA is first used."""
    if b.visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = b.visible
    if b.device.startswith("cuda"):
        import torch
        torch.cuda.set_device(torch.device(b.device))


def bind_rank(world, layout: RankLayout, gpus_per_replica: int | Sequence[int],
              env: Mapping[str, str] | None = None) -> Binding:
    """Choose and apply this rank's device (collective over `world`). On a node without
    GPUs every rank gets 'cpu'. `gpus_per_replica`: one width, or one per rollout pool."""
    env = os.environ if env is None else env
    peers = node_peers(world, layout)
    visible = visible_gpus(env)
    if visible is None:
        import torch
        visible = [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    per_pool = (gpus_per_replica,) if isinstance(gpus_per_replica, int) else tuple(gpus_per_replica)
    rank_width = replica_widths(layout, per_pool) if len(set(per_pool)) > 1 else None
    b = choose_device(world.Get_rank(), peers, role_widths(layout, per_pool[0]), visible, rank_width)
    apply_binding(b)
    return b
