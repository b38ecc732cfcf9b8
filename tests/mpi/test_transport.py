"""The MPI transport on real ranks: the orchestrator's sends never wait for a busy worker.

    .venv/bin/python -m pytest tests/mpi/test_transport.py
"""
from tests.conftest import run_mpi


def test_send_returns_before_a_busy_worker_receives(mpiexec):
    # with a blocking send the 2 ranks wait for each other and run_mpi's timeout fails the test
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_transport.py"], timeout=120)
    assert "ok: 3 sends of 8 MB returned before the worker received; in order; closed" in p.stdout, p.stdout


def test_a_training_state_is_broadcast_tensor_by_tensor_bit_for_bit(mpiexec):
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_bcast_tensors.py"], timeout=120)
    assert "ok: 6 tensors bit-equal, None stays None, a group of one passes the dict through" in p.stdout, \
        p.stdout + p.stderr
    # and a trainer group's command: the header pickled, a Train's micro-batch as one raw buffer
    assert "ok: Train arrays (3 micro-batches) and a Stop through group_command equal" in p.stdout, \
        p.stdout + p.stderr
