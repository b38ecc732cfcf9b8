"""`python -m flexmarl_hpc.status` on real Slurm jobs (running, requeued with its restart
count, completed under --follow, failed with its log tail, and found by job id through sacct),
on the local cluster of scripts/slurm_up.sh through the session fixture `slurm` of
tests/conftest.py. Its parsers: tests/unit/test_status_cli.py; a local run:
tests/e2e/test_status_local.py."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl_hpc import status
from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS as SMALL, status_cli, wait_for as _wait_for


def submit(tmp_path: Path, *overrides: str):
    from flexmarl_hpc.submit import submit as submit_run
    return submit_run(str(ROOT / "configs/local.yaml"), [*SMALL, f"run.output_dir={tmp_path}", *overrides])


@pytest.mark.slurm
def test_status_of_a_slurm_job_running_requeued_and_completed(slurm, tmp_path):
    # long enough to be running when signalled: since the doorbell waits this small game
    # trains a step in ~40 ms, and 24 steps were over before the signal came
    run = submit(tmp_path, "run.steps=300")
    _wait_for(lambda: re.search(r"] ([1-9]\d*)/300", status_cli(run.job_id).stdout), 180, "steps by job id")
    q = status_cli(run.job_id)
    assert f"slurm  job {run.job_id}: RUNNING" in q.stdout, q.stdout
    assert re.search(rf"het components: {run.job_id}\+0 RUNNING, {run.job_id}\+1 RUNNING, "
                     rf"{run.job_id}\+2 RUNNING", q.stdout), q.stdout
    assert f"run local: {tmp_path}" in q.stdout
    run.signal("USR1")                                  # checkpoint, exit 75, requeue
    _wait_for(lambda: "requeued: restart 1" in status_cli(str(tmp_path)).stdout, 120, "the requeue")
    follow = subprocess.Popen([sys.executable, "-m", "flexmarl_hpc.status", run.job_id, "--follow",
                               "--interval", "1"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.wait(timeout=300) == "COMPLETED"          # releases the requeue hold
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    frames = out.strip().split("\n\n")
    print(frames[-1])
    assert len(frames) >= 2 and "RUNNING" in out
    assert f"slurm  job {run.job_id}: COMPLETED, requeued: restart 1" in frames[-1]
    assert "300/300 (100%)" in frames[-1] and "preemption signal" in frames[-1]   # last warning line
    # by job id through accounting alone (slurmctld forgets a job MinJobAge after it ends)
    job = status.parse_sacct(status.run_cmd(["sacct", "-X", "-n", "-P", "-D", "-j", run.job_id,
                                          "-o", "JobID,State,SubmitLine"]), run.job_id)
    assert job.state == "COMPLETED" and job.restarts == 1, job
    assert Path(job.stdout).parent.parent == tmp_path


@pytest.mark.slurm
def test_status_of_a_failed_slurm_job_shows_its_log_tail(slurm, tmp_path):
    run = submit(tmp_path, "run.steps=4", "slurm.setup=['echo site set-up broke >&2', 'exit 3']")
    assert run.wait(timeout=120) == "FAILED"
    q = status_cli(run.job_id)
    assert q.returncode == 1, q.stdout
    assert f"slurm  job {run.job_id}: FAILED" in q.stdout
    assert f"--- tail of {tmp_path}/logs/{run.job_id}.err" in q.stdout and "site set-up broke" in q.stdout
    assert "store  local.h5 not created yet" in q.stdout
