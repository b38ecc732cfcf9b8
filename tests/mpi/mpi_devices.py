"""mpiexec -n 5, one node: bind_rank over a real MPI shared-memory split, as run.py calls it,
with the node showing GPUs 4,5,6,7 (torch.cuda.set_device recorded: no GPU here).
Layout: rank 0 orchestrator, ranks 1-2 replicas, ranks 3-4 one trainer group of 2."""
import os

import torch
from mpi4py import MPI

from flexmarl_hpc.runtime.devices import bind_rank
from flexmarl_hpc.config.layout import RankLayout

world = MPI.COMM_WORLD
calls = []
torch.cuda.set_device = lambda d: calls.append(str(d))
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
b = bind_rank(world, RankLayout(replicas=2, groups=1, ranks_per_group=2), 1,
              env={"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_LOCALID": str(world.Get_rank())})
got = world.gather((b.device, os.environ.get("CUDA_VISIBLE_DEVICES"), calls, b.gpus), root=0)
if world.Get_rank() == 0:
    assert got == [("cpu", None, [], ()),
                   ("cuda:0", "4", ["cuda:0"], ("4",)), ("cuda:0", "5", ["cuda:0"], ("5",)),
                   ("cuda:2", None, ["cuda:2"], ("6",)), ("cuda:3", None, ["cuda:3"], ("7",))], got
    print("bound: orchestrator cpu, replicas GPUs 4 and 5 (each its cuda:0), trainers cuda:2 and cuda:3", flush=True)
