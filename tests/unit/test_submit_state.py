"""SlurmRun.get_state when sacct and slurmctld disagree (flexmarl_hpc/submit.py): a job
requeued by hand after it ended FAILED is still FAILED in sacct until it starts again,
while slurmctld has it PENDING, and its restart was seen COMPLETED by slurmctld while sacct
said FAILED; a waiter that believed sacct gave up on a good run
(tests/slurm/test_dead_rank_slurm.py). Over a real cluster: tests/slurm."""
import pytest

from flexmarl_hpc.submit import SlurmRun


class _Sacct:
    def __init__(self, state: str) -> None:
        self.state = state

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.state


class _Run(SlurmRun):
    def __del__(self) -> None:                # submitit's looks at folders this one lacks
        pass


def _run(sacct: str, ctld: dict) -> SlurmRun:
    run = object.__new__(_Run)                # no output folder: only the state is asked
    run._job_id = "42"
    run.watcher = _Sacct(sacct)
    run.scontrol = lambda: ctld
    return run


@pytest.mark.parametrize("sacct, ctld, state", [
    ("FAILED", {"JobState": "PENDING", "Restarts": "1"}, "PENDING"),   # requeued by hand
    ("FAILED", {"JobState": "FAILED"}, "FAILED"),
    ("FAILED", {"JobState": "COMPLETED", "Restarts": "1"}, "COMPLETED"),   # the restart ended
    ("FAILED", {}, "FAILED"),                                          # slurmctld forgot it
    ("COMPLETED", {"JobState": "COMPLETED"}, "COMPLETED"),
    ("REQUEUED", {"JobState": "RUNNING"}, "RUNNING"),
    ("RUNNING", {"JobState": "FAILED"}, "RUNNING"),                    # sacct live: no ask
])
def test_slurmctld_overrides_a_stale_sacct_record(sacct, ctld, state):
    assert _run(sacct, ctld).get_state("force") == state
