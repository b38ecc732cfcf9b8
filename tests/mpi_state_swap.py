"""mpiexec -n 2: group 0 = rank 0 trains and sends its agent's state to group 1 = rank 1."""
import torch
from mpi4py import MPI

from flexmarl_hpc.state_swap import Location, StateMover
from tests.test_state_swap import make, step

world = MPI.COMM_WORLD
rank = world.Get_rank()
mover = StateMover(world, MPI.COMM_SELF, rank, lambda g: [g], {}, lambda a: make(seed=42))
if rank == 0:
    mover.trainers["a"] = make()
    step(mover.trainers["a"], 0)
    ref = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    mover.move("a", Location(0, True), Location(1, True))          # device of rank 0 -> rank 1
    assert "a" not in mover.trainers
    world.send(ref, dest=1)
else:
    mover.move("a", Location(0, True), Location(1, True))
    ref = world.recv(source=0)
    got = mover.trainers["a"].state()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    twin = make()
    twin.load_state(ref)
    step(twin, 3)
    step(mover.trainers["a"], 3)
    assert all(torch.equal(x, y) for x, y in zip(twin.state().values(), mover.trainers["a"].state().values()))
    print("rank 1 received bit-identical state, next step identical", flush=True)
