"""Run under mpiexec -n 3 by test_sync_deadline.py: a stage sender that is not the leader
gives up at the deadline, and its trainer group learns it.

    mpi_sync_deadline_stages.py BACKEND TIMEOUT_S      (BACKEND: mpi or gloo)

Ranks 0 and 1 are one trainer group of two PP stages (rank 0 the leader and stage 0's
sender, rank 1 stage 1's), rank 2 a replica that takes stage 0's buckets and then never
joins stage 1's data group. Rank 0's part completes; rank 1 raises CollectiveTimeout no
earlier than TIMEOUT_S after its start, having still run its whole stream (a megatron
sender's TP gathers are the group's collectives), abandons (1, 2); then `first_error` hands
rank 1's reason to both ranks of the group, so its leader (rank 0) reports SyncTimedOut.
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
from flexmarl_hpc.ranks.workers import first_error

world = MPI.COMM_WORLD
rank = world.Get_rank()
backend, timeout_s = sys.argv[1], float(sys.argv[2])
channels = SyncChannels(world, backend, timeout_s=timeout_s)
channels.open([SyncGroup(0, 0, (0, 1), (2,))])       # the trainer group's two stage senders, the pool
DONE = 99
# each tensor (800 B) in a bucket of its own (1 KiB): a whole bucket per next(buckets) below
stages = [{"s0.a": torch.ones(200), "s0.b": torch.ones(200)}, {"s1.a": torch.ones(200), "s1.b": torch.ones(200)}]
plan = SyncPlan((0, 1), tuple(plan_buckets(layout_of(s), 1024) for s in stages))
group = world.Split(int(rank == 2), rank)          # the trainer group {0, 1} (collective on world)
if rank == 2:
    v, got, buckets = receive_weights(channels, (0, 2))
    assert got == plan and v == 1
    for _ in range(len(plan.stages[0])):
        next(buckets)                    # stage 0's buckets, then it stays away from stage 1
    for src in (0, 1):
        comm.recv(world, source=src, tag=DONE)
    print("rank 2 stayed away from stage 1", flush=True)
else:
    streamed, err, t0 = [], None, time.monotonic()
    stream = ((k, streamed.append(k) or t) for k, t in stages[rank].items())
    try:
        send_weights(channels, (2,), plan, 1, rank, stream, leader=rank == 0)
    except CollectiveTimeout as e:
        err = e
        waited = time.monotonic() - t0
        assert waited >= timeout_s and channels.pairs[0, 0].dead, waited
        print(f"rank {rank} CollectiveTimeout in {e.phase!r} after {waited:.2f} s", flush=True)
    assert streamed == list(stages[rank]), streamed
    reason = first_error(group, None if err is None else str(err))
    print(f"rank {rank} group error: {reason}", flush=True)
    world.send("done", dest=2, tag=DONE)
channels.close()
