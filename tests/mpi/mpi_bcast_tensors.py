"""mpiexec -n 2: comm.bcast_tensors hands a training state (float, bfloat16, a 0-d int64, a
uint8 RNG state, an empty tensor) from rank 0 to rank 1 bit for bit, tensor by tensor; a
None state stays None; in a group of one the dict itself comes back, not a copy."""
import torch
from mpi4py import MPI

from flexmarl_hpc.runtime import comm

world = MPI.COMM_WORLD
g = torch.Generator().manual_seed(0)
state = {"model.w": torch.randn(3, 5, generator=g), "model.h": torch.randn(4, generator=g).bfloat16(),
         "optim.0.step": torch.tensor(7), "rng": torch.Generator().manual_seed(1).get_state(), "empty": torch.zeros(0, 2),
         "model.t": torch.randn(6, 4, generator=g).t()}                     # not contiguous
got = comm.bcast_tensors(world, state if world.Get_rank() == 0 else None, 0)
assert list(got) == list(state)
for k, v in state.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    assert torch.equal(got[k], v), k
assert comm.bcast_tensors(world, None, 0) is None
solo = world.Split(world.Get_rank(), 0)
assert comm.bcast_tensors(solo, state, 0) is state
if world.Get_rank() == 1:
    print("ok: 6 tensors bit-equal, None stays None, a group of one passes the dict through", flush=True)
