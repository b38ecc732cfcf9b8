"""Location-agnostic state transfer: device <-> host on one rank, and rank -> rank."""
import torch
from mpi4py import MPI

from flexmarl_hpc.config import TrainerConfig
from flexmarl_hpc.grpo import MicroBatch
from flexmarl_hpc.model import ModelArgs, build_model
from flexmarl_hpc.state_swap import Location, StateMover
from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
from tests.conftest import run_mpi

ARGS = ModelArgs(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                 intermediate_size=32, max_seq_len=8)


def make(seed=0):
    return TorchTrainer(build_model(ARGS, seed), TrainerConfig(lr=1e-2), MPI.COMM_SELF, 1.0)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return MicroBatch(torch.randint(3, 12, (4, 6), generator=g), torch.full((4,), 2), torch.full((4,), 4),
                      torch.zeros(4, 6), torch.randn(4, generator=g), torch.zeros(4, dtype=torch.bool), None)


def step(tr, seed):
    tr.forward_backward(batch(seed), 0.25)
    tr.optimizer_step()


def test_swap_out_and_in_is_bit_identical_and_continues_the_same():
    mover = StateMover(MPI.COMM_WORLD, MPI.COMM_SELF, 0, lambda g: [0], {}, lambda a: make(seed=99))
    mover.trainers["a"] = make()
    twin = make()
    for s in range(2):
        step(mover.trainers["a"], s)
        step(twin, s)
    before = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    mover.move("a", Location(0, True), Location(0, False))        # park in host memory
    assert "a" not in mover.trainers and "a" in mover.parked
    mover.move("a", Location(0, False), Location(0, True))        # and back on the device
    after = mover.trainers["a"].state()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    step(mover.trainers["a"], 5)
    step(twin, 5)
    for (k, x), y in zip(twin.state().items(), mover.trainers["a"].state().values()):
        assert torch.equal(x, y), k


def test_state_moves_between_ranks(mpiexec):
    p = run_mpi(mpiexec, 2, ["tests/mpi_state_swap.py"], timeout=120)
    assert "rank 1 received bit-identical state, next step identical" in p.stdout
