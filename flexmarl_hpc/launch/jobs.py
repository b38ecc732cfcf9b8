"""Slurm's view of a job, read by `status` and by the launcher's check of a run folder's owner:
each command bounded (30 s), the parsers pure.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

FAILED = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                    "DEADLINE", "REVOKED"})
"""Slurm states in which the run did not finish: the log tail is shown."""
ENDED = FAILED | {"COMPLETED"}


@dataclass
class Job:
    job_id: str
    state: str = "UNKNOWN"
    components: list[tuple[str, str]] = field(default_factory=list)   # (id, state) per het component
    restarts: int = 0
    reason: str = ""
    stdout: str = ""
    start_time: str = ""                 # scontrol's StartTime: when a pending job may start


def run_cmd(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout if p.returncode == 0 else ""


def parse_scontrol(text: str, job_id: str) -> Job | None:
    """`scontrol show job -o J`: one line per het component (HetJobOffset=k)."""
    recs = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in text.splitlines()]
    recs = [r for r in recs if r.get("JobId")]
    if not recs:
        return None
    recs.sort(key=lambda r: int(r.get("HetJobOffset", 0)))
    first = recs[0]
    comps = [(f"{job_id}+{r['HetJobOffset']}", r.get("JobState", "?")) for r in recs if "HetJobOffset" in r]
    return Job(job_id, first.get("JobState", "UNKNOWN"), comps, int(first.get("Restarts", 0)),
               first.get("Reason", "None"), first.get("StdOut", ""), first.get("StartTime", ""))


def parse_sacct(text: str, job_id: str) -> Job | None:
    """`sacct -X -n -P -D -o JobID,State,SubmitLine -j J`: a het job is J+0, J+1, ...
    (component 0 is the job's state); -D keeps the records of earlier (requeued) starts."""
    rows = [line.split("|", 2) for line in text.splitlines() if line.count("|") >= 2]
    if not rows:
        return None
    comps: dict[str, str] = {}
    starts = 0
    submit = ""
    for jid, state, line in rows:
        comps[jid] = state.split()[0]                   # "CANCELLED by 0" -> CANCELLED; last wins
        starts += jid in (job_id, f"{job_id}+0")
        submit = submit or line
    main = comps.get(f"{job_id}+0", comps.get(job_id, "UNKNOWN"))
    het = sorted((k, v) for k, v in comps.items() if "+" in k)
    m = re.search(r"(\S+)/job\.sbatch", submit)
    return Job(job_id, main, het, max(starts - 1, 0), "", f"{m.group(1)}/logs/{job_id}.out" if m else "")


def slurm_job(job_id: str) -> Job | None:
    """The job as slurmctld knows it, else as accounting remembers it; None if neither."""
    live = parse_scontrol(run_cmd(["scontrol", "show", "job", "-o", job_id]), job_id)
    acct = parse_sacct(run_cmd(["sacct", "-X", "-n", "-P", "-D", "-j", job_id,
                             "-o", "JobID,State,SubmitLine"]), job_id)
    if live is None:
        return acct
    if acct is not None and not live.stdout:
        live.stdout = acct.stdout
    return live
