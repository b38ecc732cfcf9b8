"""Run under mpiexec -n 3 by test_weight_sync.py: rank 0 plays a trainer leader, ranks 1-2 replicas."""
import sys

import torch
from mpi4py import MPI

from flexmarl_hpc.model import ModelArgs, build_model
from flexmarl_hpc.rollout.torch_engine import TorchEngine
from flexmarl_hpc.weight_sync import SyncChannels, broadcast_weights
from flexmarl_hpc.workflows.referential import ReferentialGame

world = MPI.COMM_WORLD
rank = world.Get_rank()
args = ModelArgs(vocab_size=19, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=48, max_seq_len=16, tie_embeddings=False)
bucket = int(sys.argv[1])
channels = SyncChannels(world)
task = ReferentialGame(["speaker", "listener"])
if rank == 0:
    model = build_model(args, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 19, (2, 5))).sum().backward()
    opt.step()                                      # "after a step"
    for members, version in (((0, 1, 2), 1), ((0, 2), 2)):
        broadcast_weights(channels.get(members), model.state_dict(), version, bucket)
    world.send(model.state_dict(), dest=1)
    world.send(model.state_dict(), dest=2)
else:
    engine = TorchEngine({"speaker": args}, task, max_batch=8)
    v, named = broadcast_weights(channels.get((0, 1, 2)), None, -1, bucket)
    engine.load_weights("speaker", v, named)
    if rank == 2:
        v, named = broadcast_weights(channels.get((0, 2)), None, -1, bucket)
        engine.load_weights("speaker", v, named)
    ref = world.recv(source=0)
    got = engine.models["speaker"].state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert engine.version("speaker") == (1 if rank == 1 else 2)
    print(f"rank {rank} bit-identical v{engine.version('speaker')}", flush=True)
