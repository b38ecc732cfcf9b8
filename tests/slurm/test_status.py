"""`python -m flexmarl_hpc.status`: parsers on recorded Slurm text, then real runs: a live
local run (SWMR store being written), the same run finished, and real Slurm jobs (running,
requeued with its restart count, completed under --follow, failed with its log tail, and
found by job id through sacct)."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from flexmarl_hpc import status
from tests.conftest import ROOT, run_training

SMALL = ["run.log_every=1", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
         "model.hidden_size=32", "model.intermediate_size=64"]


def status_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexmarl_hpc.status", *args], cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)


def test_parsers_read_het_components_restarts_and_the_run_folder():
    sc = ("JobId=7 HetJobId=7 HetJobOffset=0 JobName=local JobState=PENDING Reason=BeginTime Restarts=1 "
          "StdOut=/scratch/runs/a/logs/7.out\n"
          "JobId=8 HetJobId=7 HetJobOffset=1 JobName=local JobState=PENDING Reason=BeginTime Restarts=1\n")
    job = status.parse_scontrol(sc, "7")
    assert (job.state, job.reason, job.restarts, job.stdout) == ("PENDING", "BeginTime", 1, "/scratch/runs/a/logs/7.out")
    assert job.components == [("7+0", "PENDING"), ("7+1", "PENDING")]
    assert status.parse_scontrol("", "7") is None
    sa = ("7+0|REQUEUED|sbatch --parsable /scratch/runs/a/job.sbatch\n7+1|REQUEUED|sbatch --parsable /scratch/runs/a/job.sbatch\n"
          "7+0|FAILED|sbatch --parsable /scratch/runs/a/job.sbatch\n7+1|CANCELLED by 0|sbatch --parsable /scratch/runs/a/job.sbatch\n")
    job = status.parse_sacct(sa, "7")
    assert (job.state, job.restarts, job.stdout) == ("FAILED", 1, "/scratch/runs/a/logs/7.out")
    assert job.components == [("7+0", "FAILED"), ("7+1", "CANCELLED")]


def test_status_of_a_live_then_finished_local_run(tmp_path, mpiexec):
    """While the run writes (SWMR) status shows a partial bar with an ETA; once it is over,
    the bar is full, the rewards are the store's last ones and the checkpoints are listed."""
    steps = 40
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, f"run.steps={steps}"]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    live = []
    try:
        while p.poll() is None:
            if (tmp_path / "config.yaml").exists():
                q = status_cli(str(tmp_path))
                assert q.returncode == 0, q.stderr
                m = re.search(r"\] (\d+)/40 .*ETA (\d+:\d\d:\d\d)", q.stdout)
                if m and 0 < int(m.group(1)) < steps:
                    live.append(q.stdout)
            time.sleep(1.0)
    finally:
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert live, "never saw the run in progress"
    print(live[-1])
    assert "speed " in live[-1] and "samples/s" in live[-1] and "reward speaker" in live[-1]

    q = status_cli(str(tmp_path), "--follow", "--interval", "0.2")       # over: returns at once
    assert q.returncode == 0, q.stderr
    print(q.stdout)
    assert re.search(r"\[#+\] 40/40 \(100%\).* done", q.stdout)
    with h5py.File(tmp_path / "local.h5", "r") as f:
        last = {a: float(f[f"steps/{a}"]["reward_mean"][-1]) for a in ("speaker", "listener")}
    assert f"reward speaker {last['speaker']:.3f}  listener {last['listener']:.3f}  (step 40)" in q.stdout
    assert "ckpt   listener v000040.pt" in q.stdout and "speaker v000040.pt" in q.stdout
    assert "slurm" not in q.stdout                     # a local run has no job


def test_status_refuses_what_it_cannot_find(tmp_path):
    q = status_cli(str(tmp_path / "nope"))
    assert q.returncode == 2 and "no such run folder, and not a Slurm job id" in q.stderr


# ---------------------------------------------------------------------------------------
# real Slurm (the local cluster of scripts/slurm_up.sh, through test_slurm's fixture)
# ---------------------------------------------------------------------------------------
from tests.test_slurm import _wait_for, slurm  # noqa: E402,F401  (the session fixture)


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
    job = status.parse_sacct(status._cmd(["sacct", "-X", "-n", "-P", "-D", "-j", run.job_id,
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
