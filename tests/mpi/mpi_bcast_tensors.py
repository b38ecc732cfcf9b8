"""mpiexec -n 2: comm.bcast_tensors hands a training state (float, bfloat16, a 0-d int64, a
uint8 RNG state, an empty tensor) from rank 0 to rank 1 bit for bit, tensor by tensor; a
None state stays None; in a group of one the dict itself comes back, not a copy. Then
workers.group_command hands a Train command (a packed micro-batch: int64, float32, a [B, V]
bool mask, a transposed array, None; and an empty step) and a Stop to the member equal,
the arrays as aligned views torch takes as they are, and refuses an object array by name."""
import torch
import numpy as np
from mpi4py import MPI

from flexmarl_hpc.ranks.workers import group_command
from flexmarl_hpc.runtime import comm, messages
from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays

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

rng = np.random.default_rng(0)
arrays = {"input_ids": rng.integers(0, 50, (5, 7)), "prompt_lens": np.arange(5), "response_lens": np.arange(5) + 1,
          "behav_logprobs": rng.standard_normal((7, 5), dtype=np.float32).T,        # not contiguous
          "advantages": rng.standard_normal(5, dtype=np.float32), "stale": np.array([True, False] * 2 + [True]),
          "allowed": rng.random((5, 11)) < 0.5}
for arr in (arrays, {**arrays, "allowed": None}, {k: None if a is None else a[:0] for k, a in arrays.items()}):
    cmd = messages.Train("a", 3, arr, 0.25, True)
    got = group_command(world, cmd if world.Get_rank() == 0 else None)
    assert (got.agent, got.step, got.scale, got.last) == ("a", 3, 0.25, True) and list(got.arrays) == list(arr)
    for k, a in arr.items():
        assert (got.arrays[k] is None) if a is None else (got.arrays[k].dtype == a.dtype
                                                          and np.array_equal(got.arrays[k], a)), k
    microbatch_from_arrays(got.arrays)                # torch takes the views (aligned)
assert group_command(world, messages.Stop(3) if world.Get_rank() == 0 else None) == messages.Stop(3)
try:
    comm.array_meta({"ids": np.array([[1], "x"], dtype=object)})
    raise AssertionError("an object array was accepted")
except TypeError as e:
    assert "'ids'" in str(e), e
if world.Get_rank() == 1:
    print("ok: Train arrays (3 micro-batches) and a Stop through group_command equal; object arrays refused",
          flush=True)
