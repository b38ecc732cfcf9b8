"""Run under mpiexec -n 3 by test_sync_deadline.py: a member of a weight sync never joins.

    mpi_sync_deadline.py BACKEND TIMEOUT_S      (BACKEND: mpi or gloo)

Rank 0 sends (a trainer leader), ranks 1-2 receive, all in the one sync group made at start.
v1 over (0, 1, 2) goes through; rank 2 then stays away: v2 over (0, 1) still arrives
bit-equal (a replica outside a sync takes no part in it), v3 over (0, 1, 2) must end on ranks
0 and 1 with CollectiveTimeout in the rendezvous, no earlier than TIMEOUT_S after the sync
began; the members answer again, and refuse v4 over the abandoned group by name.
"""
import sys
import time

import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime.deadline import CollectiveTimeout
from flexmarl_hpc.config.sync_groups import SyncGroup
from flexmarl_hpc.runtime.weight_sync import (SyncPlan, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, send_weights)

world = MPI.COMM_WORLD
rank = world.Get_rank()
backend, timeout_s = sys.argv[1], float(sys.argv[2])
channels = SyncChannels(world, backend, timeout_s=timeout_s)
channels.open([SyncGroup(0, 0, (0,), (1, 2))])
BUCKET = 1 << 20                        # 5 buckets a sync: each waited under the deadline
DONE = 99


def weights(version: int) -> dict[str, torch.Tensor]:          # 4 MiB: past MPICH's eager sizes
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(7, generator=g)}


def sync(members, version):
    if rank == members[0]:
        named, targets = weights(version), members[1:]
        plan = SyncPlan((rank,), (plan_buckets(layout_of(named), BUCKET),))
        send_weights(channels, targets, plan, version, 0, named.items(), leader=True)
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
        assert channels.pairs[0, 0].dead                                  # never used again
        print(f"rank {rank} v{version} CollectiveTimeout in {e.phase!r} after {waited:.2f} s: {e}", flush=True)
        return
    raise AssertionError(f"rank {rank}: v{version} over {members} completed without rank 2")


sync((0, 1, 2), 1)
if rank == 2:                           # never joins again; leaves once the others are done
    for src in (0, 1):
        comm.recv(world, source=src, tag=DONE)
    print("rank 2 stayed away", flush=True)
else:
    sync((0, 1), 2)
    expect_timeout((0, 1, 2), 3, "the rendezvous")
    try:
        sync((0, 1), 4)
    except RuntimeError as e:
        assert "abandoned" in str(e), e
        print(f"rank {rank} v4 refused: {str(e)[:60]}", flush=True)
    world.send("done", dest=2, tag=DONE)
assert channels.comms_built == 1, channels.comms_built
channels.close()
