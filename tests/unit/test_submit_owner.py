"""One writer per run folder, whatever the order of submissions (flexmarl_hpc/launch/owner.py,
submit.check_writable): the run lock is held only while rank 0 runs, so `submit` also asks
Slurm about the jobs the folder names (logs/<id>.sbatch|.job|.out, the lock record) and
refuses one that is pending, held or requeued; `submit --sweep` runs every check for every
task before it writes anything. Slurm is faked: scontrol's text (pure functions), or a fake
`scontrol`/`sbatch` on PATH for the submit shell; no cluster is needed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.launch.owner import check_owner, folder_jobs, live_job
from flexmarl_hpc.store.lock import Holder
from flexmarl_hpc.submit import submit, submit_sweep
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs" / "local.yaml")


def scontrol_text(job_id: str, *states: str, reason: str = "None", restarts: int = 0) -> str:
    """`scontrol show job -o` of a job with one line per (het) component."""
    return "".join(f"JobId={int(job_id) + k} HetJobId={job_id} HetJobOffset={k} JobName=local UserId=u(1) "
                   f"JobState={st} Reason={reason} Restarts={restarts} StdOut=/r/logs/{job_id}.out\n"
                   for k, st in enumerate(states))


@pytest.mark.parametrize("states, reason, restarts", [
    (("PENDING",) * 3, "BeginTime", 1),          # the requeue hold after a restart
    (("PENDING",) * 3, "JobHeldUser", 0),        # scontrol hold
    (("PENDING",) * 3, "Resources", 0),          # never started yet
    (("REQUEUED",) * 3, "None", 1),
    (("REQUEUE_HOLD",) * 3, "JobHeldAdmin", 1),
    (("SPECIAL_EXIT",) * 3, "None", 1),
    (("RUNNING",) * 3, "None", 0),
    (("COMPLETED", "COMPLETING", "COMPLETED"), "None", 0),   # a component still ending
])
def test_a_job_that_may_still_run_owns_the_folder(states, reason, restarts):
    job = live_job([("42", scontrol_text("42", *states, reason=reason, restarts=restarts))])
    assert job is not None and (job.job_id, job.state, job.reason, job.restarts) == ("42", states[0], reason, restarts)


@pytest.mark.parametrize("text", [scontrol_text("42", "COMPLETED", "COMPLETED"),
                                  scontrol_text("42", "FAILED", "CANCELLED"), scontrol_text("42", "PREEMPTED"),
                                  scontrol_text("42", "TIMEOUT"), ""])         # "": slurmctld forgot it
def test_an_ended_or_forgotten_job_owns_nothing(text):
    assert live_job([("42", text)]) is None


def test_the_folder_names_its_jobs_newest_first(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("41.sbatch", "41.out", "42.out", "7_1.job", "notes.out", "x.sbatch", "43.restarts"):
        (logs / name).write_text("")
    (tmp_path / ".lock").write_bytes(Holder("n1", 5, "44", "2026-11-29T00:00:00+00:00").encode())
    assert folder_jobs(tmp_path) == ["44", "42", "41", "7_1"]
    assert folder_jobs(tmp_path / "none") == []


def test_check_owner_asks_until_a_live_job_and_names_it_on_one_line(tmp_path):
    (tmp_path / "logs").mkdir()
    for i in ("40", "41", "42"):
        (tmp_path / "logs" / f"{i}.sbatch").write_text("")
    texts = {"42": "", "41": scontrol_text("41", "PENDING", "PENDING", reason="BeginTime", restarts=2),
             "40": scontrol_text("40", "RUNNING")}
    asked = []
    with pytest.raises(ConfigError) as e:
        check_owner(tmp_path, lambda i: asked.append(i) or texts[i])
    assert asked == ["42", "41"]                 # newest first, no further than the owner
    assert str(e.value) == (f"run.output_dir: {tmp_path} belongs to Slurm job 41 (PENDING, reason BeginTime, "
                            "requeued 2 time(s)), which may still write it; wait for it to end (or scancel 41) "
                            "or use another run.output_dir")


def fake_slurm(tmp_path, monkeypatch, scontrol: str) -> object:
    """A PATH whose `scontrol` prints `scontrol` and whose `sbatch` records that it was called."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text(f"#!/bin/sh\ncat <<'EOF'\n{scontrol}EOF\n")
    (bin_ / "sbatch").write_text(f"#!/bin/sh\ntouch {bin_}/sbatch_called\necho 99\n")
    for f in ("scontrol", "sbatch"):
        (bin_ / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    return bin_ / "sbatch_called"


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resubmission_while_the_first_job_sits_in_its_requeue_hold_is_refused(tmp_path, monkeypatch):
    """The issue's order: job 42 exited 75 and waits PENDING (BeginTime) to restart; it holds
    no lock. A second submit onto its folder was accepted, and job 42 then failed on the lock."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "42.sbatch").write_text("#!/bin/bash\n")
    (out / "config.yaml").write_text("run: {name: local}  # job 42's\n")
    before = snapshot(out)
    called = fake_slurm(tmp_path, monkeypatch, scontrol_text("42", "PENDING", "PENDING", "PENDING",
                                                             reason="BeginTime", restarts=1))
    with pytest.raises(ConfigError, match=r"belongs to Slurm job 42 \(PENDING, reason BeginTime, requeued 1"):
        submit(CONFIG, [f"run.output_dir={out}"], check_partitions=False)
    assert snapshot(out) == before and not called.exists()


HOLD = """
import sys, time
from flexmarl_hpc.store.lock import acquire
lock = acquire(sys.argv[1], notice=print)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("trouble", ["lock held", "damaged store"])
def test_a_sweep_onto_a_live_or_damaged_folder_is_refused_and_writes_nothing(tmp_path, monkeypatch, trouble):
    base = tmp_path / "sweep"
    live = base / "trainer.lr=3e-4"              # the sweep's second task folder
    live.mkdir(parents=True)
    (live / "config.yaml").write_text("run: {name: local}  # the live run's\n")
    called = fake_slurm(tmp_path, monkeypatch, "")
    holder = None
    if trouble == "lock held":
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(live)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert holder.stdout.readline().startswith("held")
    else:
        (live / "local.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)   # truncated
    before = snapshot(live)
    try:
        with pytest.raises(ConfigError, match="in use by another run" if holder else "cannot resume"):
            submit_sweep(CONFIG, [f"run.output_dir={base}"], "trainer.lr=1e-3,3e-4", check_partitions=False)
    finally:
        if holder is not None:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
    assert snapshot(live) == before
    assert not (base / "trainer.lr=1e-3").exists() and not (base / "sweep_logs").exists() and not called.exists()
