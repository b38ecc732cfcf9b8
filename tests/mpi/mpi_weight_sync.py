"""Run under mpiexec -n 3 by test_weight_sync.py: rank 0 plays a trainer leader, ranks 1-2 replicas.

    mpi_weight_sync.py BUCKET_BYTES BACKEND      (BACKEND: mpi or gloo)

Two agents of different sizes go through member sets {0,1,2} and {0,2}, streamed in buckets;
every rank must end with bit-equal weights, at most two bucket buffers on the sender and one
on each replica however many member sets and models they served.
"""
import sys

import torch
from mpi4py import MPI

from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
from flexmarl_hpc.rollout.torch_engine import TorchEngine
from flexmarl_hpc.runtime.weight_sync import (GroupIds, Plan, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, send_weights)
from flexmarl_hpc.workflows.referential import ReferentialGame

world = MPI.COMM_WORLD
rank = world.Get_rank()
small = ModelArgs(vocab_size=19, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=48, max_seq_len=16, tie_embeddings=False)
big = ModelArgs(vocab_size=19, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                intermediate_size=96, max_seq_len=16, tie_embeddings=True)
bucket, backend = int(sys.argv[1]), sys.argv[2]
channels = SyncChannels(world, backend)
task = ReferentialGame(["speaker", "listener"])
# (agent, member set, version, wire): the big agent to both replicas, then the small one and
# the big one again to {0,2}: rank 2 serves two member sets and two models out of one bucket
# buffer; the last {0,2} syncs carry a plan {0,2} already saw (the 24-byte path); then the
# small one to both in bfloat16 (the GPU wire dtype): a new plan on {0,1,2}
plan = [("listener", (0, 1, 2), 1, None), ("speaker", (0, 2), 1, None), ("listener", (0, 2), 2, None),
        ("listener", (0, 2), 3, None), ("speaker", (0, 1, 2), 2, torch.bfloat16)]
if rank == 0:
    models = {"speaker": build_model(small, seed=7), "listener": build_model(big, seed=8)}
    ids = GroupIds()

    def step(m):                                        # weights "after a step"
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.randint(0, 19, (2, 5))).sum().backward()
        opt.step()

    expect = {1: {}, 2: {}}
    for agent, members, version, wire in plan:
        step(models[agent])
        named = hf_state_dict(models[agent])
        targets = members[1:]
        p = Plan((0,), (plan_buckets(layout_of(named), bucket, wire),), (ids.use(0, targets),), (ids.live(0),))
        send_weights(channels, targets, p, version, 0, named.items(), leader=True)
        for r in targets:
            expect[r][agent] = {k: v.to(wire or v.dtype).float().clone()
                               for k, v in models[agent].state_dict().items()}
    for dest in (1, 2):
        world.send(expect[dest], dest=dest)
    assert channels.buffer_allocations <= 2, channels.buffer_allocations     # 2 slots, sized by the first plan
else:
    engine = TorchEngine({"speaker": small, "listener": big}, task, max_batch=8)
    for agent, members, _, _ in plan:
        if rank in members:
            v, _, buckets = receive_weights(channels, members)
            engine.load_weights(agent, v, buckets)
    ref = world.recv(source=0)
    assert set(engine.models) == {"speaker", "listener"}
    for agent in engine.models:
        got = engine.models[agent].state_dict()
        assert set(got) == set(ref[agent])
        for k in ref[agent]:
            assert got[k].dtype == ref[agent][k].dtype and torch.equal(got[k], ref[agent][k]), (agent, k)
    assert engine.version("listener") == (1 if rank == 1 else 3) and engine.version("speaker") == 2
    assert channels._buffers[1] is None and channels.buffer_allocations == 1   # one bucket buffer
    print(f"rank {rank} bit-identical v{engine.version('listener')} one buffer", flush=True)
channels.close()
