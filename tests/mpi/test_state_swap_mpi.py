"""State transfer rank -> rank over real MPI (tests/mpi/mpi_state_swap.py on 2 ranks)."""
from tests.conftest import run_mpi


def test_state_moves_between_ranks(mpiexec):
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_state_swap.py"], timeout=120)
    assert "rank 1 received bit-identical state, next step identical" in p.stdout
