import pytest

from tests.conftest import run_mpi


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("bucket", [1000, 1 << 22])     # many small buckets / one bucket
def test_replicas_get_trainer_weights_bit_for_bit(mpiexec, bucket, backend):
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_weight_sync.py", str(bucket), backend], timeout=120)
    assert "rank 1 bit-identical v1 one buffer" in p.stdout
    assert "rank 2 bit-identical v3 one buffer" in p.stdout
