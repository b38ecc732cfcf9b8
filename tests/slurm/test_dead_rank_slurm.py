"""A rank SIGKILLed in a running het job (the OOM killer, a node failure), or one that hangs
(SIGSTOP): the other components end within seconds instead of idling to the wall-clock limit
(no --kill-on-bad-exit: docs/slurm.md), the batch script reads the end as the requeue code
whatever srun reports (runtime/requeue.py), Slurm requeues the job with no human, and the
rest of the run trains every sample exactly once. On the local cluster of scripts/slurm_up.sh
(fixture `slurm`); the same kills under mpiexec: tests/mpi/test_dead_rank.py.

    pytest tests/slurm/test_dead_rank_slurm.py
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid

import pytest

from flexmarl_hpc.submit import submit
from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS as SMALL, check_exactly_once, job_tails, steps_logged, wait_for

sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  (scripts/faults.py: rank_pids finds ranks by their launcher rank and a tag)

STEPS = 300                       # ~40 ms each: the kill lands mid-run
BOUND_S = 60.0                    # the bound: kill -> every component ended


@pytest.mark.slurm
@pytest.mark.parametrize("victim,sig", [(0, "KILL"), (1, "KILL"), (2, "KILL"), (1, "STOP")],
                         ids=["orchestrator", "replica", "trainer", "hung-replica"])
def test_a_lost_rank_ends_the_job_which_slurm_requeues_and_the_run_resumes_exactly_once(
        slurm, tmp_path, monkeypatch, victim, sig):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("FLEXMARL_FAULT_TAG", tag)        # sbatch exports it: the ranks carry it
    # start_timeout: a restart whose MPI start-up hangs (docs/slurm.md) is requeued again in time
    run = submit(str(ROOT / "configs/local.yaml"), [*SMALL, f"run.steps={STEPS}", f"run.output_dir={tmp_path}",
                                                   "slurm.start_timeout=60", "run.worker_timeout=15"])
    try:
        wait_for(lambda: steps_logged(run) >= 3, 180, "3 steps")
        pids = wait_for(lambda: (p := faults.rank_pids(tag, "flexmarl_hpc.run")) and len(p) == 4 and p,
                        30, "the 4 ranks' processes")
        os.kill(pids[victim], getattr(signal, f"SIG{sig}"))
        t0 = time.monotonic()
        bound = BOUND_S + (15 if sig == "STOP" else 0)  # a hung rank is found at run.worker_timeout
        wait_for(lambda: not faults.rank_pids(tag, "flexmarl_hpc.run") or "restart 1 " in run.stdout(),
                 bound, "every rank to end")
        ranks_s = time.monotonic() - t0
        out = wait_for(lambda: re.search(r"ranks exited (\d+) at \S+( \(srun: \d+\))?", run.stdout()), 60,
                       "the batch script's end")
        print(f"SIG{sig} rank {victim}: ranks gone in {ranks_s:.1f} s, {out.group(0)}")
        assert out.group(1) == "75", job_tails(run)      # not srun's 137: Slurm requeues it
        text = run.stdout()
        if victim == 0:
            err = run.paths.stderr.read_text()
            assert "the orchestrator (rank 0) has ended (its liveness socket closed): exiting 75" in err, err[-3000:]
            assert "exit 75 (the orchestrator (rank 0) was lost): requeueing" in text, text[-3000:]
        else:
            who = "replica 0 (rank 1)" if victim == 1 else "trainer group 0 (leader) (rank 2)"
            log = (tmp_path / "train.log").read_text()
            what = "no answer to" if sig == "STOP" else "its process has ended (liveness socket closed)"
            assert f"{who}: {what}" in log, log[-2000:]
            # a rank hung inside a weight sync leaves its peer (the sending trainer) unanswered
            # too, and the first to time out is named
            named = "was lost or hung): requeueing" if sig == "STOP" else f"exit 75 ({who} was lost or hung)"
            assert named in text, text[-3000:]
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
