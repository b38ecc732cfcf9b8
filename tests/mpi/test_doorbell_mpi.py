"""The orchestrator's star over real MPI: tests/mpi/mpi_doorbell.py on 3 ranks (the doorbell
itself on socket pairs: tests/unit/test_doorbell.py)."""
from tests.conftest import run_mpi


def test_the_orchestrator_star_over_mpi(mpiexec):
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_doorbell.py"], timeout=180)
    assert "ok: star of 2 workers; commands and an 8 MB micro-batch delivered; idle waits asleep" \
        in p.stdout, p.stdout
