"""A rank that hangs in MPI start-up (a PMI exchange that never completes: docs/slurm.md,
'MPI start-up') does not hold the job to its time limit: the batch script's watchdog ends
the step after slurm.start_timeout, the job is requeued, and the next incarnation runs the
whole run, every sample trained exactly once. On the local cluster of scripts/slurm_up.sh.

    pytest tests/slurm/test_start_watchdog_slurm.py
"""
from __future__ import annotations

import pytest

from flexmarl_hpc.submit import submit
from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS as SMALL, check_exactly_once, job_tails, steps_logged

STEPS = 6
TIMEOUT_S = 15


@pytest.mark.slurm
def test_a_rank_hung_in_mpi_start_up_is_ended_and_the_job_requeued(slurm, tmp_path, monkeypatch):
    # rank 1 stalls before MPI_Init in the first incarnation only (faults.py); the
    # other ranks then wait in MPI_Init's PMI exchange for it, as in a PMI hang
    monkeypatch.setenv("FLEXMARL_FAULT", "mpi_start:1:1:stall:restart=0")
    run = submit(str(ROOT / "configs/local.yaml"), [*SMALL, f"run.steps={STEPS}", f"run.output_dir={tmp_path}",
                                                   f"slurm.start_timeout={TIMEOUT_S}"])
    try:
        try:
            h5 = run.result(timeout=240)                  # wait() releases the requeue hold
        except TimeoutError:
            pytest.fail(f"the job did not end: {job_tails(run)}")
        text = run.stdout()
        assert f"were not through MPI start-up after {TIMEOUT_S} s" in text, job_tails(run)
        assert "ranks exited 75" in text and f"job {run.job_id} restart 1" in text, job_tails(run)
        assert steps_logged(run) == STEPS
        check_exactly_once(h5, STEPS)
    finally:
        run.cancel(check=False)


@pytest.mark.slurm
def test_a_start_that_fails_every_time_stops_after_max_restarts_with_one_line(slurm, tmp_path, monkeypatch):
    # rank 1 stalls before MPI_Init in every incarnation: the watchdog ends each one, and
    # with slurm.max_restarts=1 the second failure in a row (no checkpoint in between)
    # stops the job instead of requeueing it for good
    monkeypatch.setenv("FLEXMARL_FAULT", "mpi_start:1:1:stall")
    run = submit(str(ROOT / "configs/local.yaml"), [*SMALL, f"run.steps={STEPS}", f"run.output_dir={tmp_path}",
                                                   f"slurm.start_timeout={TIMEOUT_S}", "slurm.max_restarts=1"])
    try:
        try:
            state = run.wait(timeout=240)
        except TimeoutError:
            pytest.fail(f"the job did not stop: {job_tails(run)}")
        text = run.stdout()
        assert state == "FAILED", job_tails(run)
        stops = [line for line in text.splitlines() if "not requeueing" in line]
        assert stops == [f"flexmarl_hpc: not requeueing: 2 incarnations in a row ended without a new "
                         f"checkpoint (slurm.max_restarts=1), the last: the ranks were not through MPI "
                         f"start-up after {TIMEOUT_S} s (slurm.start_timeout). Fix that, then submit the "
                         f"same command to resume."], job_tails(run)
        assert f"job {run.job_id} restart 1 " in text and f"job {run.job_id} restart 2 " not in text, job_tails(run)
        assert steps_logged(run) == 0
    finally:
        run.cancel(check=False)
