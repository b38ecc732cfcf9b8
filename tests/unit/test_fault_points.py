"""The fault injector (flexmarl_hpc/faults.py) finds its rank under every launcher: MPICH's PMI
(mpiexec, srun --mpi=pmi2) and PMIx (srun --mpi=pmix with Open MPI). With PMI_RANK alone it
was read as rank 0 on every Open MPI rank, so a fault aimed at rank 0 fired on all of them."""
from __future__ import annotations

import pytest

from flexmarl_hpc.faults import launcher_rank


@pytest.mark.parametrize("env,rank", [({"PMI_RANK": "3"}, 3), ({"PMIX_RANK": "2", "SLURM_PROCID": "0"}, 2),
                                      ({"OMPI_COMM_WORLD_RANK": "5"}, 5), ({"SLURM_PROCID": "1"}, None), ({}, None)])
def test_the_launcher_rank_is_read_from_pmi_pmix_or_open_mpi(env, rank):
    assert launcher_rank(env) == rank
