import pytest

from tests.conftest import run_mpi


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
# many small buckets (most tensors in pieces) / a third of the largest tensor (the MLP
# weights in 3 pieces, the rest packed) / one bucket
@pytest.mark.parametrize("bucket", ["1000", "third", str(1 << 22)])
def test_replicas_get_trainer_weights_bit_for_bit(mpiexec, bucket, backend):
    """Bit-equal weights on both replicas, the sender within two buckets (tensor bytes)."""
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_weight_sync.py", bucket, backend], timeout=120)
    assert "rank 0 sender peak" in p.stdout
    assert "rank 1 bit-identical v1 buffers bounded" in p.stdout
    assert "rank 2 bit-identical v3 buffers bounded" in p.stdout
