"""How is my run doing: one screen from the run folder, its HDF5 store and Slurm.

    python -m flexmarl_hpc.status runs/local              # a run folder (live or finished)
    python -m flexmarl_hpc.status 4242                    # a Slurm job id (squeue/scontrol/sacct)
    python -m flexmarl_hpc.status 4242 --follow           # refresh every 5 s until the job ends

Shows the Slurm state of the job and of each het component (PENDING with its reason,
RUNNING, requeued with the restart count, COMPLETED, FAILED with the log tail), a progress
bar of steps with ETA (or "stalled" when no step came for long: STALL_FACTOR), per-agent reward (and eval, when the store has /eval), failed
episodes by kind (when the store has /failures rows), samples/s,
utilization, the last checkpoint of each agent and the last warning/error lines of the log.

The store is read with plain h5py in SWMR mode (`h5py.File(p, "r", swmr=True)`), so this
works while the run writes, and only reads /metrics, /steps/<agent>, /eval and the `kind`
column of /failures, not the samples.
A job id leads to its run folder through `scontrol` (StdOut=<run_dir>/logs/<id>.out) while
Slurm remembers the job, then through sacct's SubmitLine (`sbatch ... <run_dir>/job.sbatch`);
a run folder leads to its newest job through the `logs/<id>.sbatch` that submit records.
Exit code: 0 shown (with --follow: the run ended well), 1 the job or run failed, 2 not found.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import yaml

from flexmarl_hpc.launch.jobs import ENDED, FAILED, Job, parse_sacct, parse_scontrol, run_cmd, slurm_job  # noqa: F401
from flexmarl_hpc.store.checksum import StoreDamaged, verify_store

WARN = re.compile(r"warn|error|traceback|exception|killed|abort|preemption signal|requeue", re.I)


class StatusError(Exception):
    """The target is neither a run folder nor a job Slurm or the run folders know."""


def hold_line(job: Job, now: datetime) -> str:
    """A pending job's state with its reason, and for a requeue hold (BeginTime) how long it
    still waits and how to end the wait."""
    if job.state != "PENDING" or job.reason in ("", "None"):
        return job.state
    if job.reason != "BeginTime" or not job.start_time:
        return f"PENDING ({job.reason})"
    try:
        wait = (datetime.fromisoformat(job.start_time) - now).total_seconds()
    except ValueError:
        return f"PENDING (held until {job.start_time})"
    return (f"PENDING (requeue hold until {job.start_time}, {hms(max(wait, 0))} from now; "
            f"`scontrol update jobid={job.job_id} StartTime=now` or `submit --wait` ends it)")


JOB_ID = re.compile(r"\d+(_\d+)?")
"""A Slurm job id, or a sweep's array task (ARRAYID_TASK)."""


def _id_key(job_id: str) -> tuple[int, int]:
    job, _, task = job_id.partition("_")
    return int(job), int(task or -1)


def find_run(target: str) -> tuple[Path, str | None]:
    """(run folder, newest job id or None) of a run folder or a job id. A sweep's array task
    (`29_0`) writes its Slurm log under the sweep's base folder; its own run folder is the
    one whose `logs/29_0.job` names it (submit_sweep writes it)."""
    p = Path(target)
    if p.is_dir():
        ids = [f.stem for f in (p / "logs").glob("*.sbatch") if f.stem.isdigit()]
        ids += [f.stem for f in (p / "logs").glob("*.job") if JOB_ID.fullmatch(f.stem)]
        return p.resolve(), max(ids, key=_id_key) if ids else None
    if not JOB_ID.fullmatch(target):
        raise StatusError(f"{target}: no such run folder, and not a Slurm job id")
    job = slurm_job(target)
    if job is None or not job.stdout:
        raise StatusError(f"job {target}: neither scontrol nor sacct knows it (or where it writes); "
                          f"pass its run folder instead")
    folder = Path(job.stdout).parent.parent
    if "_" in target and not (folder / "logs" / f"{target}.job").exists():
        task = next(folder.glob(f"*/logs/{target}.job"), None)
        if task is None:
            raise StatusError(f"job {target}: no run folder under {folder} names it (logs/{target}.job); "
                              "pass its run folder instead")
        folder = task.parent.parent
    return folder, target


# ---------------------------------------------------------------------------------------
# the run folder and its store
# ---------------------------------------------------------------------------------------
@dataclass
class Progress:
    total: int
    done: int = 0
    t_run: float = 0.0                   # seconds from the store's t0 to the last step
    t_last: float = 0.0                  # when the last step was committed (epoch seconds)
    s_per_step: float = 0.0
    median_step_s: float = 0.0           # median wall time of the last 10 steps
    samples_per_s: float = 0.0
    utilization: float = 0.0
    reward: dict[str, float] = field(default_factory=dict)
    eval: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)      # failed episodes by kind
    error: str = ""


def read_store(path: Path, total: int) -> Progress:
    """Progress from /metrics and /steps/<agent> (and /eval when present), SWMR-safe."""
    pr = Progress(total)
    if not path.exists():
        pr.error = f"store  {path.name} not created yet"
        return pr
    try:
        with h5py.File(path, "r", swmr=True) as f:
            verify_store(f, path, ("/metrics", "/steps/", "/eval", "/failures"))      # the tables it reads
            m = f["metrics"]
            step, t = m["step"][:], m["t"][:]
            if len(step):
                last = slice(-min(len(step), 10), None)        # recent rate: the last 10 steps
                pr.done, pr.t_run = int(step.max()) + 1, float(t[-1])
                pr.samples_per_s = float(np.mean(m["samples_per_s"][last]))
                pr.utilization = float(np.mean(m["utilization"][last]))
                pr.s_per_step = float(np.mean(m["wall"][last]))
                pr.median_step_s = float(np.median(m["wall"][last]))
                pr.t_last = float(f.attrs["t0"]) + pr.t_run
            for agent in f.attrs["agents"]:        # at the last global step: agents run apart
                s = f[f"steps/{agent}"]
                rows = np.nonzero(s["step"][:] == pr.done - 1)[0]
                if len(rows):
                    pr.reward[agent] = float(s["reward_mean"][rows[-1]])
            pr.eval = read_eval(f)
            pr.failures = read_failures(f)
    except StoreDamaged as e:
        pr.error = f"store  {e}"
    except (OSError, KeyError) as e:                   # not created / not in SWMR mode yet
        pr.error = f"store  {path.name} not readable yet ({e.__class__.__name__}: {e})"
    return pr


def read_eval(f: h5py.File) -> dict[str, dict[str, float]]:
    """The latest evaluation in /eval (store.py EVAL_COLUMNS): {agent or "task": {"step":
    its step, metric[/sample]: value}}; committed rows only."""
    if "eval" not in f or "commit" not in f:
        return {}
    committed = dict(zip((str(x) for x in f["commit"].attrs["tables"]), f["commit"][:].tolist()))
    rows = f["eval"][:committed.get("/eval", 0)]
    if not len(rows):
        return {}
    out: dict[str, dict[str, float]] = {}
    last = rows[rows["step"] == rows["step"].max()]
    for r in last:
        d = out.setdefault(r["agent"].decode() or "task", {"step": float(r["step"])})
        mode = r["mode"].decode()
        d[r["metric"].decode() + ("" if mode == "greedy" else f"/{mode}")] = float(r["value"])
    return out


def read_failures(f: h5py.File) -> dict[str, int]:
    """Failed episodes by kind (/failures, schema 5; committed rows only), most first."""
    if "failures" not in f or "commit" not in f:
        return {}
    committed = dict(zip((str(x) for x in f["commit"].attrs["tables"]), f["commit"][:].tolist()))
    kinds, counts = np.unique(f["failures"]["kind"][:committed.get("/failures", 0)], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return {kinds[i].decode("utf-8", "replace"): int(counts[i]) for i in order}


def checkpoints(run_dir: Path) -> dict[str, tuple[str, float]]:
    """{agent: (latest checkpoint file, age in seconds)} from checkpoints/<agent>/latest."""
    out = {}
    for latest in sorted((run_dir / "checkpoints").glob("*/latest")):
        name = latest.read_text().strip()
        f = latest.parent / name
        out[latest.parent.name] = (name, time.time() - (f if f.exists() else latest).stat().st_mtime)
    return out


def log_files(run_dir: Path, job_id: str | None) -> list[Path]:
    files = [run_dir / "logs" / f"{job_id}.{e}" for e in ("out", "err")] if job_id else []
    return [f for f in files + [run_dir / "train.log"] if f.exists()]


def tail(path: Path, n: int, keep=lambda line: True) -> list[str]:
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, 2) - 256 * 1024))   # a log can be large: its end is enough
        lines = fh.read().decode(errors="replace").splitlines()
    return [ln for ln in lines if keep(ln)][-n:]


# ---------------------------------------------------------------------------------------
# one screen
# ---------------------------------------------------------------------------------------
def bar(done: int, total: int, width: int = 30) -> str:
    k = int(width * done / total) if total else 0
    return "[" + "#" * k + "-" * (width - k) + "]"


STALL_FACTOR, STALL_MIN_S = 10.0, 120.0
"""A run is stalled when no step was committed for max(STALL_FACTOR x the median of the
last 10 step times, STALL_MIN_S) seconds: ten steps' time is far past a slow step (an
evaluation, a checkpoint), and the floor covers runs of sub-second steps."""


def stalled_for(pr: Progress, now: float) -> float | None:
    """Seconds since the last committed step when that is past the stall bound, else None
    (also before the first step and once every step is done)."""
    if not pr.done or pr.done >= pr.total:
        return None
    idle = now - pr.t_last
    return idle if idle > max(STALL_FACTOR * pr.median_step_s, STALL_MIN_S) else None


def progress_line(pr: Progress, now: float, state: str = "RUNNING") -> str:
    """The steps line: bar, elapsed, then done / ETA, or STALLED. `state`: the Slurm job's
    (RUNNING without a job); a job that is not running gets no ETA and is never stalled."""
    head = (f"steps  {bar(pr.done, pr.total)} {pr.done}/{pr.total} "
            f"({100 * pr.done / max(pr.total, 1):.0f}%)  elapsed {hms(pr.t_run)}  ")
    if pr.done >= pr.total:
        return head + "done"
    if state != "RUNNING":
        return head + f"no ETA: the job is {state}"
    if not pr.done:
        return head + "ETA after the first step"
    idle = stalled_for(pr, now)
    if idle is not None:
        return head + (f"stalled: no step committed for {hms(idle)} (median step "
                       f"{pr.median_step_s:.2f} s); a rank may have died or hung, see the logs")
    eta = (pr.total - pr.done) * pr.s_per_step
    return head + f"ETA {hms(eta)} ({pr.s_per_step:.2f} s/step)"


def hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def idle_for(run_dir: Path) -> float:
    """Seconds since anything in the run folder's store or logs was written."""
    files = [*run_dir.glob("*.h5"), *run_dir.glob("*.log"), *run_dir.glob("logs/*")]
    return time.time() - max((f.stat().st_mtime for f in files), default=0.0)


def render(run_dir: Path, job: Job | None, job_id: str | None, stale: float = 300.0) -> tuple[str, bool, bool]:
    """(the screen, the run has ended, it ended badly). Without a Slurm job, a run has ended
    when all its steps are in the store or nothing was written for `stale` seconds."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    run = cfg.get("run", {})
    name, total = run.get("name", run_dir.name), int(run.get("steps", 0))
    store = run_dir / f"{name}.h5"
    pr = read_store(store, total)
    out = [f"run {name}: {run_dir}  (store {store.name}, mode {run.get('mode', '?')})"]
    ended, failed = (pr.total > 0 and pr.done >= pr.total) or idle_for(run_dir) > stale, False
    if job_id:
        if job is None:
            out.append(f"slurm  job {job_id}: unknown to squeue/scontrol/sacct (purged?)")
        else:
            st = hold_line(job, datetime.now())
            rq = f", requeued: restart {job.restarts}" if job.restarts else ""
            out.append(f"slurm  job {job_id}: {st}{rq}")
            if job.components:
                out.append("       het components: " + ", ".join(f"{c} {s}" for c, s in job.components))
            ended, failed = job.state in ENDED, job.state in FAILED or any(s in FAILED for _, s in job.components)
    if pr.error:
        out.append(pr.error)
    else:
        out.append(progress_line(pr, time.time(), "RUNNING" if job is None else job.state))
        out.append("reward " + "  ".join(f"{a} {r:.3f}" for a, r in pr.reward.items())
                   + (f"  (step {pr.done})" if pr.reward else ""))
        for agent, ev in pr.eval.items():
            out.append(f"eval   {agent} " + "  ".join(f"{k} {v:.4g}" for k, v in ev.items()))
        if pr.failures:
            out.append(f"failed {sum(pr.failures.values())} episodes: "
                       + ", ".join(f"{k} {n}" for k, n in pr.failures.items()) + "  (analyze: messages)")
        out.append(f"speed  {pr.samples_per_s:.1f} samples/s  utilization {100 * pr.utilization:.0f}% "
                   f"(mean of the last 10 steps)")
    ck = checkpoints(run_dir)
    out.append("ckpt   " + ("  ".join(f"{a} {n} ({hms(age)} ago)" for a, (n, age) in ck.items()) or "none yet"))
    logs = log_files(run_dir, job_id)
    warn = [f"{f.name}: {ln}" for f in logs for ln in tail(f, 3, WARN.search)]
    if warn:
        out += ["last warnings/errors:", *(f"  {w}" for w in warn[-5:])]
    if failed:
        for f in logs[:2]:
            out += [f"--- tail of {f}", *(f"  {ln}" for ln in tail(f, 15))]
    return "\n".join(out), ended, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.status", description=__doc__.split("\n")[0])
    ap.add_argument("target", help="a run folder (run.output_dir) or a Slurm job id")
    ap.add_argument("--follow", action="store_true", help="refresh until the job (or run) ends")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (--follow)")
    ap.add_argument("--stale", type=float, default=300.0,
                    help="a run without a Slurm job has ended when nothing was written for this long")
    args = ap.parse_args(argv)
    try:
        run_dir, job_id = find_run(args.target)
    except StatusError as e:
        print(f"status: {e}", file=sys.stderr)
        return 2
    tty = sys.stdout.isatty()
    while True:
        job = slurm_job(job_id) if job_id else None
        screen, ended, failed = render(run_dir, job, job_id, args.stale)
        if args.follow and tty:
            print("\x1b[H\x1b[2J", end="")          # redraw in place on a terminal
        print(screen + ("" if tty or not args.follow else "\n"), flush=True)
        if not args.follow or ended:
            return 1 if failed else 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
