"""Run under mpiexec -n 3 by test_weight_sync.py: rank 0 plays a trainer leader, ranks 1-2 replicas.

    mpi_weight_sync.py BUCKET_BYTES BACKEND      (BACKEND: mpi or gloo; BUCKET_BYTES "third":
                                                  a third of the largest tensor)

Two agents of different sizes go through member sets {0,1,2} and {0,2}, streamed in buckets
inside the one sync group of (trainer 0, pool {1,2}) made at start (a chain 0 -> 1 -> 2, or
0 -> 2); every rank must end with bit-equal weights and one communicator (and, over gloo, one
torch group), whatever the member sets, at most two bucket buffers on the sender and one
on the chain's last replica (a relay: one more, of at most a bucket) however many member
sets and models they served. Tensors larger than a
bucket go in pieces: the sender's tensor bytes during each sync (runtime/memtrack) stay
within two buckets, and a replica's one buffer within a bucket or the largest tensor.
"""
import sys

import torch
from mpi4py import MPI

from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict
from flexmarl_hpc.rollout.torch_engine import TorchEngine
from flexmarl_hpc.runtime.memtrack import TensorBytes
from flexmarl_hpc.config.sync_groups import SyncGroup
from flexmarl_hpc.runtime.weight_sync import (SyncPlan, SyncChannels, layout_of, plan_buckets,
                                              receive_weights, send_weights)
from flexmarl_hpc.workflows.referential import ReferentialGame

world = MPI.COMM_WORLD
rank = world.Get_rank()
small = ModelArgs(vocab_size=19, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=48, max_seq_len=16, tie_embeddings=False)
big = ModelArgs(vocab_size=19, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                intermediate_size=96, max_seq_len=16, tie_embeddings=True)
LARGEST = big.intermediate_size * big.hidden_size * 4         # an MLP weight, fp32
bucket = LARGEST // 3 if sys.argv[1] == "third" else int(sys.argv[1])
backend = sys.argv[2]
channels = SyncChannels(world, backend)
channels.open([SyncGroup(0, 0, (0,), (1, 2))])
task = ReferentialGame(["speaker", "listener"])
# (agent, member set, version, wire): the big agent to both replicas, then the small one and
# the big one again to {0,2}: rank 2 serves two member sets and two models out of one bucket
# buffer; the last {0,2} syncs carry a plan {0,2} already saw (the 24-byte path); then the
# small one to both in bfloat16 (the GPU wire dtype): a new plan on {0,1,2}
plan = [("listener", (0, 1, 2), 1, None), ("speaker", (0, 2), 1, None), ("listener", (0, 2), 2, None),
        ("listener", (0, 2), 3, None), ("speaker", (0, 1, 2), 2, torch.bfloat16)]
if rank == 0:
    models = {"speaker": build_model(small, seed=7), "listener": build_model(big, seed=8)}

    def step(m):                                        # weights "after a step"
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.randint(0, 19, (2, 5))).sum().backward()
        opt.step()

    expect, peaks = {1: {}, 2: {}}, []
    for agent, members, version, wire in plan:
        step(models[agent])
        named = hf_state_dict(models[agent])
        targets = members[1:]
        p = SyncPlan((0,), (plan_buckets(layout_of(named), bucket, wire),))
        with TensorBytes() as mem:
            send_weights(channels, targets, p, version, 0, named.items(), leader=True)
        peaks.append(mem.peak)
        assert mem.peak <= 2 * bucket, (agent, version, mem.peak, bucket)      # two buffers, nothing else
        for r in targets:
            expect[r][agent] = {k: v.to(wire or v.dtype).float().clone()
                               for k, v in models[agent].state_dict().items()}
    for dest in (1, 2):
        world.send(expect[dest], dest=dest)
    assert peaks[0] > 0 and all(b.numel() <= bucket for b in channels._buffers if bucket < LARGEST), peaks
    if bucket >= LARGEST:
        assert channels.buffer_allocations <= 2, channels.buffer_allocations   # 2 slots, sized by the first plan
    print(f"rank 0 sender peak {max(peaks)} B, bucket {bucket} B, largest tensor {LARGEST} B", flush=True)
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
    assert channels._buffers[0].numel() <= max(bucket, LARGEST), channels._buffers[0].numel()
    if rank == 2:                  # always the chain's last link: one bucket buffer
        assert channels._buffers[1] is None and channels.buffer_allocations == 1
    else:                          # a relay in (0, 1, 2): whole buckets in two buffers in turn
        assert channels._buffers[1] is None or channels._buffers[1].numel() <= bucket
    print(f"rank {rank} bit-identical v{engine.version('listener')} buffers bounded", flush=True)
assert channels.comms_built == 1 and channels.groups_built == (backend == "gloo"), \
    (channels.comms_built, channels.groups_built)                 # the pair's, made at start
channels.close()
