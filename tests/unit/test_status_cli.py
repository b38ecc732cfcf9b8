"""`python -m flexmarl_hpc.status` without a run: its parsers on recorded Slurm text, and the
refusal of what it cannot find. A live run: tests/e2e/test_status_local.py; real Slurm jobs:
tests/slurm/test_status.py."""
from flexmarl_hpc import status
from tests.helpers import status_cli


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



def test_status_refuses_what_it_cannot_find(tmp_path):
    q = status_cli(str(tmp_path / "nope"))
    assert q.returncode == 2 and "no such run folder, and not a Slurm job id" in q.stderr
