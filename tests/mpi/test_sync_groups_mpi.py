"""The weight-sync groups are made once at start, one per (trainer group, pool): many syncs to
changing replica subsets build no more (tests/mpi/mpi_sync_groups.py), and every subset gets
its weights bit-equal."""
import re

import pytest

from tests.conftest import run_mpi


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_syncs_to_changing_replica_subsets_build_one_group_per_trainer_group_and_pool(mpiexec, backend):
    p = run_mpi(mpiexec, 5, ["tests/mpi/mpi_sync_groups.py", backend], timeout=240)
    built = {int(r): (int(s), int(c), int(g), int(n)) for r, s, c, g, n in re.findall(
        r"rank (\d) 24 syncs, served (\d+), built (\d+) communicators and (\d+) groups for (\d+) pairs", p.stdout)}
    assert sorted(built) == [0, 1, 2, 3, 4], p.stdout
    for r in (0, 1):                    # a leader: 12 syncs to 7 distinct subsets, one pair
        assert built[r][1:] == (1, int(backend == "gloo"), 1), built
    for r in (2, 3, 4):                 # a replica: in both pairs, in 14-16 of the syncs
        assert built[r][0] >= 14 and built[r][1:] == (2, 2 * int(backend == "gloo"), 2), built
