"""A rank SIGKILLed in a running het job (the OOM killer, a node failure): the other
components end within seconds instead of idling to the wall-clock limit (no
--kill-on-bad-exit: docs/slurm.md), the job is requeued or ends requeueable, and the rest of
the run trains every sample exactly once. On the local cluster of scripts/slurm_up.sh
(fixture `slurm`); the same kills under mpiexec: tests/mpi/test_dead_rank.py.

    pytest tests/slurm/test_dead_rank_slurm.py
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from flexmarl_hpc.submit import SlurmRun, submit
from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS as SMALL, check_exactly_once, job_tails, steps_logged, wait_for

sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  (scripts/faults.py: rank_pids finds ranks by PMI_RANK and a tag)

STEPS = 300                       # ~40 ms each: the kill lands mid-run
BOUND_S = 60.0                    # the bound: kill -> every component ended


def _running(job_id: str) -> bool:
    p = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return "RUNNING" in p.stdout or "COMPLETING" in p.stdout


@pytest.mark.slurm
@pytest.mark.parametrize("victim", [0, 1], ids=["orchestrator", "replica"])
def test_a_killed_rank_ends_the_job_and_the_run_resumes_exactly_once(slurm, tmp_path, monkeypatch, victim):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("FLEXMARL_FAULT_TAG", tag)        # sbatch exports it: the ranks carry it
    # start_timeout: a restart whose MPI start-up hangs (docs/slurm.md) is requeued again in time
    run = submit(str(ROOT / "configs/local.yaml"), [*SMALL, f"run.steps={STEPS}", f"run.output_dir={tmp_path}",
                                                   "slurm.start_timeout=60"])
    try:
        wait_for(lambda: steps_logged(run) >= 3, 180, "3 steps")
        pids = wait_for(lambda: (p := faults.rank_pids(tag, "flexmarl_hpc.run")) and len(p) == 4 and p,
                        30, "the 4 ranks' processes")
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not faults.rank_pids(tag, "flexmarl_hpc.run"), BOUND_S, "every rank to end")
        ranks_s = time.monotonic() - t0
        wait_for(lambda: not _running(run.job_id), BOUND_S, "every component to leave RUNNING")
        job_s = time.monotonic() - t0
        out = wait_for(lambda: re.search(r"ranks exited (\d+)", run.stdout()), 60, "the batch script's end")
        print(f"SIGKILL rank {victim}: ranks gone in {ranks_s:.1f} s, job not RUNNING after {job_s:.1f} s, "
              f"srun exit {out.group(1)}")
        err = run.paths.stderr.read_text()
        if victim == 0:
            assert "the orchestrator (rank 0) has ended (its liveness socket closed): exiting 75" in err, err[-3000:]
        else:
            log = (tmp_path / "train.log").read_text()
            assert "replica 0 (rank 1): its process has ended (liveness socket closed)" in log, log[-2000:]
        if out.group(1) != "75":
            # not requeued by the script (srun reports the killed rank's signal): requeueable
            p = subprocess.run(["scontrol", "requeue", run.job_id], capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr
            # sacct keeps the ended record's FAILED until the requeued job starts: wait for
            # slurmctld to count the restart, or result() reads the old record as the end
            wait_for(lambda: int(run.scontrol().get("Restarts", "0")) >= 1, 60, "slurmctld to count the requeue")
        try:
            h5 = run.result(timeout=300)                  # wait() releases the requeue hold
        except TimeoutError:
            pytest.fail(f"the requeued job did not end: {job_tails(run)}")
        text = run.stdout()
        assert f"job {run.job_id} restart 1" in text and "resumed at versions" in text, text[-3000:]
        assert steps_logged(run) == STEPS
        check_exactly_once(h5, STEPS)
    finally:
        run.cancel(check=False)
