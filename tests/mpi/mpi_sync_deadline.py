"""Run under mpiexec -n 3 by test_sync_deadline.py: a member of a weight sync never joins.

    mpi_sync_deadline.py BACKEND TIMEOUT_S      (BACKEND: mpi or gloo)

Rank 0 sends (a trainer leader), ranks 1-2 receive. v1 over (0, 1, 2) goes through; rank 2
then stays away: v2 over (0, 1, 2) must end on ranks 0 and 1 with CollectiveTimeout in the
rendezvous, v3 over the new member set (0, 2) on rank 0 in the join, each no earlier than
TIMEOUT_S after the sync began; the members answer again: v4 over (0, 1) arrives bit-equal.
"""
import sys
import time

import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime.deadline import CollectiveTimeout
from flexmarl_hpc.runtime.weight_sync import (GroupIds, Plan, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, send_weights)

world = MPI.COMM_WORLD
rank = world.Get_rank()
backend, timeout_s = sys.argv[1], float(sys.argv[2])
channels = SyncChannels(world, backend, timeout_s=timeout_s)
BUCKET = 1 << 20                        # 5 buckets a sync: each waited under the deadline
DONE = 99
ids = GroupIds()


def weights(version: int) -> dict[str, torch.Tensor]:          # 4 MiB: past MPICH's eager sizes
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(7, generator=g)}


def sync(members, version):
    if rank == members[0]:
        named, targets = weights(version), members[1:]
        plan = Plan((rank,), (plan_buckets(layout_of(named), BUCKET),), (ids.use(0, targets),), (ids.live(0),))
        try:
            send_weights(channels, targets, plan, version, 0, named.items(), leader=True)
        except CollectiveTimeout:
            ids.drop(targets)           # as TrainerRank.sync does: the set gets new groups
            raise
        return
    v, _, buckets = receive_weights(channels, members)
    got = {k: t.clone() for b in buckets for k, t in b.items()}
    assert v == version and all(torch.equal(got[k], t) for k, t in weights(version).items())
    print(f"rank {rank} bit-identical v{v}", flush=True)


def expect_timeout(members, version, phase):
    t0 = time.monotonic()
    try:
        sync(members, version)
    except CollectiveTimeout as e:
        waited = time.monotonic() - t0
        assert e.phase.startswith(phase), e.phase
        assert members not in channels.cache and all(k[0] != members for k in channels.groups)   # forgotten
        print(f"rank {rank} v{version} CollectiveTimeout in {e.phase!r} after {waited:.2f} s: {e}", flush=True)
        return
    raise AssertionError(f"rank {rank}: v{version} over {members} completed without rank 2")


sync((0, 1, 2), 1)
if rank == 2:                           # never joins again; leaves once the others are done
    for src in (0, 1):
        comm.recv(world, source=src, tag=DONE)
    print("rank 2 stayed away", flush=True)
else:
    expect_timeout((0, 1, 2), 2, "the rendezvous")
    if rank == 0:
        expect_timeout((0, 2), 3, "joining")
        world.send("v3 over", dest=1, tag=DONE)
    else:                               # v4 starts when rank 0 is back, as the orchestrator's order would have it
        comm.recv(world, source=0, tag=DONE)
    sync((0, 1), 4)
    world.send("done", dest=2, tag=DONE)
channels.close()
