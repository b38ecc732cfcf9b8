"""Run under mpiexec -n 5 by test_sync_groups.py: two trainer groups, one pool of three
replicas, many syncs to changing replica subsets; the communicators never outnumber the
(trainer group, pool) pairs.

    mpi_sync_groups.py BACKEND      (BACKEND: mpi or gloo)

Ranks 0 and 1 are the leaders (and only ranks) of trainer groups 0 and 1, ranks 2-4 the
replicas of one pool, the pairs made at start from config/sync_groups.sync_groups of a real
config. Each leader syncs its agent 12 times, to every non-empty subset of the replicas in
turn (a different chain each time), interleaved with the other leader's syncs in one global
order as the orchestrator issues them; every replica checks each version bit-equal. Every
rank then counts what it built: one MPI communicator (and, over gloo, one torch group) per
pair it is in, the number of pairs it is in, however many distinct subsets it served. The
on-demand creation this replaced made one per distinct member set (7 per leader here).
"""
import itertools
import sys

import torch
from mpi4py import MPI

from flexmarl_hpc.config.load import load_plan
from flexmarl_hpc.runtime.weight_sync import (SyncPlan, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, send_weights)

world = MPI.COMM_WORLD
rank = world.Get_rank()
backend = sys.argv[1]
plan = load_plan("configs/local.yaml", ["rollout.replicas=3", "trainer.groups=2"])
layout, groups = plan.layout, plan.sync_groups
assert [(g.group, g.pool, g.members) for g in groups] == [(0, 0, (4, 1, 2, 3)), (1, 0, (5, 1, 2, 3))], groups
# this job has no orchestrator: world rank r plays layout rank r + 1 (leaders 4, 5 -> 0, 1; replicas 1-3 -> 2-4)
remap = {4: 0, 5: 1, 1: 2, 2: 3, 3: 4}
groups = [type(g)(g.group, g.pool, tuple(remap[r] for r in g.senders), tuple(remap[r] for r in g.replicas),
                  g.agents) for g in groups]
channels = SyncChannels(world, backend)
channels.open(groups)
subsets = [s for n in (1, 2, 3) for s in itertools.combinations((2, 3, 4), n)]
order = [(leader, subset) for subset in subsets + subsets[::-1][:5] for leader in (0, 1)]      # 24 syncs


def weights(leader: int, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * leader + version)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g)}


served = 0
for version, (leader, targets) in enumerate(order, 1):
    if rank == leader:
        named = weights(leader, version)
        plan = SyncPlan((leader,), (plan_buckets(layout_of(named), 4096),))       # several buckets, pieces
        send_weights(channels, targets, plan, version, 0, named.items(), leader=True)
    elif rank in targets:
        v, _, buckets = receive_weights(channels, (leader,) + targets)
        got = {k: t.clone() for b in buckets for k, t in b.items()}
        assert v == version and all(torch.equal(got[k], t) for k, t in weights(leader, version).items())
        served += 1
pairs = sum(rank in g.members for g in groups)
assert channels.comms_built == pairs and channels.groups_built == (pairs if backend == "gloo" else 0), \
    (rank, channels.comms_built, channels.groups_built, pairs)
print(f"rank {rank} {len(order)} syncs, served {served}, built {channels.comms_built} communicators "
      f"and {channels.groups_built} groups for {pairs} pairs", flush=True)
channels.close()
