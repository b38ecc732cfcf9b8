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


def _store_with_steps(path, walls: list[float], age_s: float) -> None:
    """A real store (StoreFile) whose /metrics holds one row per step of `walls` seconds,
    the last committed `age_s` seconds ago."""
    import time

    import h5py
    from flexmarl_hpc.store.tables import StoreFile
    st = StoreFile(path, ["a"], {"config_yaml": "", "mode": "flex", "world_size": 4})
    t = 0.0
    for step, wall in enumerate(walls):
        t += wall
        row = {k: [0] for k in ("samples", "tokens", "rollout_s", "train_s", "sync_s", "swap_s", "staleness_max")}
        st.metrics.append({**row, "step": [step], "t": [t], "wall": [wall], "samples_per_s": [1.0],
                           "utilization": [0.5]})
    st.flush()
    st.close()
    with h5py.File(path, "r+") as f:
        f.attrs["t0"] = time.time() - age_s - t


def test_status_says_stalled_when_no_step_came_for_much_longer_than_a_step(tmp_path):
    """A store whose last step is older than max(10 x the median recent step, 120 s) is
    'stalled', not given an ETA; a younger one keeps its ETA (both sides of each bound)."""
    import time
    cases = [([2.0] * 12, 100.0, False), ([2.0] * 12, 130.0, True),     # the 120 s floor
             ([30.0] * 12, 250.0, False), ([30.0] * 12, 320.0, True)]   # 10 x the median step
    for walls, age, stalled in cases:
        path = tmp_path / f"s{walls[0]}_{age}.h5"
        _store_with_steps(path, walls, age)
        pr = status.read_store(path, 100)
        line = status.progress_line(pr, time.time())
        assert ("stalled: no step committed for" in line) == stalled, (walls[0], age, line)
        assert ("ETA" in line) == (not stalled), line
        # a job that is not running (pending in a requeue hold, failed) is neither stalled nor given an ETA
        for state in ("PENDING", "FAILED", "REQUEUED"):
            line = status.progress_line(pr, time.time(), state)
            assert line.endswith(f"no ETA: the job is {state}"), line
    pr = status.read_store(path, 12)                                     # every step done
    assert status.progress_line(pr, time.time()).endswith("done")


def test_a_requeue_hold_shows_its_wait_and_how_to_end_it():
    from datetime import datetime
    sc = ("JobId=7 HetJobId=7 HetJobOffset=0 JobState=PENDING Reason=BeginTime Restarts=1 "
          "StartTime=2026-11-29T04:02:00 StdOut=/scratch/runs/a/logs/7.out\n")
    job = status.parse_scontrol(sc, "7")
    assert job.start_time == "2026-11-29T04:02:00"
    line = status.hold_line(job, datetime(2026, 11, 29, 4, 0, 30))
    assert line == ("PENDING (requeue hold until 2026-11-29T04:02:00, 0:01:30 from now; "
                    "`scontrol update jobid=7 StartTime=now` or `submit --wait` ends it)"), line
    job.reason = "Resources"
    assert status.hold_line(job, datetime(2026, 11, 29, 4, 0, 30)) == "PENDING (Resources)"
    job.state = "RUNNING"
    assert status.hold_line(job, datetime(2026, 11, 29, 4, 0, 30)) == "RUNNING"


def test_a_sweeps_array_task_resolves_to_its_own_run_folder(tmp_path, monkeypatch):
    """`status 29_1` (JOBID_TASK) finds the task's folder, not the sweep's base folder where
    submitit writes the array's Slurm logs; a task folder shows its array task's id."""
    base = tmp_path / "sweep"
    for i, value in enumerate(("1e-3", "1e-4")):
        logs = base / f"trainer.lr={value}" / "logs"
        logs.mkdir(parents=True)
        (logs / f"29_{i}.job").write_text("array task\n")
    (base / "sweep_logs").mkdir()
    monkeypatch.setattr(status, "slurm_job", lambda job_id: status.Job(
        job_id, "RUNNING", stdout=str(base / "sweep_logs" / f"{job_id}_0_log.out")))
    assert status.find_run("29_1") == (base / "trainer.lr=1e-4", "29_1")
    assert status.find_run(str(base / "trainer.lr=1e-3")) == ((base / "trainer.lr=1e-3").resolve(), "29_0")
    try:
        status.find_run("29_7")
        raise AssertionError("an array task no folder names was found")
    except status.StatusError as e:
        assert "logs/29_7.job" in str(e)
    assert "not a Slurm job id" in status_cli("29_x").stderr
