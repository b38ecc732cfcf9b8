"""Which Slurm job owns a run folder, for `submit`: the run lock (store/lock.py) is held only
while rank 0 runs, so a job that is pending, held or in its requeue hold holds nothing, and a
second submission onto its folder was accepted (the first then failed on the lock when it
started). The folder names its jobs: `logs/<id>.sbatch` (one per submission, written by
submit), `logs/<id>.job` (a sweep's array task), `logs/<id>.out` (the job's --output) and the
lock record's Slurm job. Slurm says
whether each may still run (`scontrol show job -o`).

    check_owner(out)     # ConfigError: one line naming the job and its state
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterable

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.launch.jobs import ENDED, Job, parse_scontrol
from flexmarl_hpc.store.lock import LOCK_NAME, RECORD_BYTES, parse_record

OVER = ENDED | {"PREEMPTED"}
"""States of a job that will not start again by itself (a preempted job Slurm requeues shows
REQUEUED, then PENDING); every other state (PENDING, RUNNING, REQUEUED, REQUEUE_HOLD,
SPECIAL_EXIT, SUSPENDED, COMPLETING, CONFIGURING, ...) may still write the folder."""


def folder_jobs(out: Path) -> list[str]:
    """The Slurm job ids a run folder names, newest first (pure: reads the folder only)."""
    logs = Path(out) / "logs"
    ids = {f.stem for pattern in ("*.sbatch", "*.job", "*.out") for f in logs.glob(pattern)}
    try:
        with open(Path(out) / LOCK_NAME, "rb") as f:
            holder = parse_record(f.read(RECORD_BYTES))
    except OSError:
        holder = None
    if holder is not None and holder.job:
        ids.add(holder.job)
    ids = {i for i in ids if i.replace("_", "").replace("+", "").isdigit()}
    return sorted(ids, key=lambda i: [int(p) for p in i.replace("+", "_").split("_")], reverse=True)


def live_job(texts: Iterable[tuple[str, str]]) -> Job | None:
    """The first job of (id, `scontrol show job -o` text) pairs that may still run (pure; an
    empty text is a job slurmctld has forgotten: over). Lazy: a generator is read no further."""
    for job_id, text in texts:
        job = parse_scontrol(text, job_id)
        if job is not None and (job.state not in OVER or any(s not in OVER for _, s in job.components)):
            return job
    return None


def owner_error(out: Path, job: Job) -> ConfigError:
    why = f", reason {job.reason}" if job.reason and job.reason != "None" else ""
    again = f", requeued {job.restarts} time(s)" if job.restarts else ""
    return ConfigError(f"run.output_dir: {out} belongs to Slurm job {job.job_id} ({job.state}{why}{again}), "
                       f"which may still write it; wait for it to end (or scancel {job.job_id}) or use "
                       "another run.output_dir")


def _scontrol(job_id: str) -> str:
    try:
        p = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""                                # no Slurm here: sbatch will say so
    return p.stdout if p.returncode == 0 else ""


def check_owner(out: Path, scontrol=_scontrol) -> None:
    """Refuse (ConfigError, one line) when a Slurm job the folder names may still run.
    Writes nothing."""
    job = live_job((i, scontrol(i)) for i in folder_jobs(out))
    if job is not None:
        raise owner_error(out, job)
