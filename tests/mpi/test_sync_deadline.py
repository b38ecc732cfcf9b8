"""A hung weight sync becomes an error within weight_sync.timeout_s (runtime/deadline.py),
on real MPI ranks: a member that never joins leaves the others with CollectiveTimeout, not
waiting until the job's wall-clock limit; they answer again afterwards, and refuse a sync
over the abandoned (trainer group, pool) group by name. What the
orchestrator then does (checkpoint, exit 75) is tests/unit/test_orchestrator.py's
test_a_sync_timeout_checkpoints_and_ends_the_job_with_the_requeue_code."""
import re

import pytest

from flexmarl_hpc.runtime.weight_sync import receiver_grace
from tests.conftest import run_mpi

TIMEOUT_S = 2.0
GRACE_S = receiver_grace(TIMEOUT_S)
SLACK_S = 8.0
"""Beyond the timeout: the back-off's last sleep, a loaded 2-core machine's scheduling."""


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_member_that_never_joins_ends_the_sync_in_a_timeout(mpiexec, backend):
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_sync_deadline.py", backend, str(TIMEOUT_S)], timeout=120)
    out = p.stdout
    assert "rank 1 bit-identical v1" in out and "rank 2 bit-identical v1" in out, out
    assert "rank 1 bit-identical v2" in out, out            # rank 2, away, is not in that sync
    waits = {(int(r), int(v)): (phase, float(s)) for r, v, phase, s in re.findall(
        r"rank (\d) v(\d) CollectiveTimeout in '([^']*)' after ([\d.]+) s", out)}
    assert set(waits) == {(0, 3), (1, 3)}, out
    assert waits[0, 3][0] == waits[1, 3][0] == "the rendezvous (every member joining)"
    # the sender gives up at the timeout, a receiver a grace later (so a live sender reports first)
    assert TIMEOUT_S <= waits[0, 3][1] <= waits[1, 3][1] <= TIMEOUT_S + GRACE_S + SLACK_S, waits
    assert waits[1, 3][1] >= TIMEOUT_S + GRACE_S, waits
    assert "rank 0 v4 refused" in out and "rank 1 v4 refused" in out and "rank 2 stayed away" in out, out


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_stage_sender_that_times_out_is_its_groups_failure(mpiexec, backend):
    """PP stage 1's sender (not the leader) gives up; the leader, whose part went through,
    still learns it (workers.first_error), so the group's reply is SyncTimedOut."""
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_sync_deadline_stages.py", backend, str(TIMEOUT_S)], timeout=120)
    out = p.stdout
    assert "rank 0 CollectiveTimeout" not in out, out
    m = re.search(r"rank 1 CollectiveTimeout in '([^']*)' after ([\d.]+) s", out)
    assert m and m.group(1) == "a bucket", out
    assert TIMEOUT_S <= float(m.group(2)) <= TIMEOUT_S + SLACK_S, out
    for r in (0, 1):
        assert re.search(rf"rank {r} group error: weight sync over ranks \[1, 2\]: a bucket", out), out
    assert "rank 2 stayed away from stage 1" in out, out
