"""Device binding over a real MPI node split: tests/mpi/mpi_devices.py on 5 ranks (the layout
and choose_device on env dicts: tests/unit/test_layout.py)."""


def test_bind_rank_over_a_real_mpi_node_split(mpiexec):
    """The wiring run.py uses: MPI's shared-memory split finds the node's ranks, replicas get
    CUDA_VISIBLE_DEVICES narrowed to their GPU, trainers torch.cuda.set_device."""
    from tests.conftest import run_mpi
    p = run_mpi(mpiexec, 5, ["tests/mpi/mpi_devices.py"], timeout=120)
    assert "replicas GPUs 4 and 5" in p.stdout
