"""mpiexec -n 2: group 0 = rank 0 trains and sends its agent's state to group 1 = rank 1,
first from the device (resident), then again from rank 0's host memory after a local
swap-out (a shelved trainer's state), and back."""
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime.state_swap import Location, StateMover
from tests.helpers import make, step

world = MPI.COMM_WORLD
rank = world.Get_rank()
mover = StateMover(world, MPI.COMM_SELF, rank, lambda g: [g], {}, lambda a: make(seed=42))
R0, P0, R1 = Location(0, True), Location(0, False), Location(1, True)


def check(ref):
    got = mover.trainers["a"].state()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    twin = make()
    twin.load_state(ref)
    step(twin, 3)
    step(mover.trainers["a"], 3)
    assert all(torch.equal(x, y) for x, y in zip(twin.state().values(), mover.trainers["a"].state().values()))


if rank == 0:
    mover.trainers["a"] = make()
    step(mover.trainers["a"], 0)
    ref = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    mover.move("a", R0, R1)                      # device of rank 0 -> rank 1
    assert "a" not in mover.trainers
    world.send(ref, dest=1)
    mover.move("a", R1, P0)                      # back, into rank 0's host memory
    ref = world.recv(source=1)
    mover.move("a", P0, R0)                      # swap in locally (a remote arrival is built once)
    check(ref)
    mover.move("a", R0, P0)                      # shelve (offload) locally ...
    ref = {k: v.clone() for k, v in mover.parked["a"].items()}
    mover.move("a", P0, R1)                      # ... and send from the shelf to rank 1
    assert "a" not in mover.parked
    world.send(ref, dest=1)
else:
    mover.move("a", R0, R1)
    check(world.recv(source=0))
    ref = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    mover.move("a", R1, P0)
    world.send(ref, dest=0)
    mover.move("a", P0, R1)
    check(world.recv(source=0))
    print("rank 1 received bit-identical state, next step identical", flush=True)
