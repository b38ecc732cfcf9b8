"""vLLM's TP workers are processes spawned by a replica rank, with the rank's MPI environment:
nothing they import for our worker extension may initialise MPI (MPICH's PMI_Init fails in
such a child, exit 15). tests/mpi/mpi_vllm_workers.py runs the worker side of a real gloo
weight sync in two spawned workers of an mpiexec rank; what in it is not vLLM's is said there."""
from tests.conftest import run_mpi


def test_spawned_tp_workers_of_a_rank_join_and_receive_a_weight_sync_over_gloo(mpiexec):
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_vllm_workers.py"], timeout=240)
    assert "replica: 2 spawned TP workers joined over gloo and loaded v1, v2 bit-equal" in p.stdout, p.stdout
